"""A worker's side of ``--strategy ps``: the samples it trains on, and its push of gradients and pull of
parameters (the server's side is :mod:`labkit.strategies.ps.server`).

A worker pushes each shard's flat gradient to that shard's server (``isend``) and waits for the reply, a
``[version, stop]`` header and the shard's new parameters (``irecv``), every wait under ``--ps-timeout-s``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, Sampler

from labkit.errors import ConfigError
from labkit.parallel.data_parallel import ShardSampler
from labkit.strategies.ps.server import wait

#: async workers i draw their order from seed + STREAM · i (worker 0: the sync order on one worker)
STREAM = 1_000_003


class NoSamples(Sampler[int]):
    """The servers' evaluation sampler: they hold no data."""

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def worker_sampler(dataset: Dataset, train: bool, seed: int, mode: str, workers: int, index: int,
                   is_server: bool) -> Sampler:
    """Worker ``index``'s sampler (of ``workers``): in sync mode a shard of every epoch, in async/ssp mode the
    whole set in its own order; for evaluation a shard of the set, and nothing on a server."""
    if not train:
        return NoSamples() if is_server else ShardSampler(dataset, workers, index)
    if mode == "sync":
        if len(dataset) < workers:
            raise ConfigError(f"the training set has {len(dataset)} samples for {workers} workers")
        return DistributedSampler(dataset, num_replicas=workers, rank=index, shuffle=True, seed=seed,
                                  drop_last=True)
    return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed + STREAM * index,
                              drop_last=True)


def push_pull(shards: Sequence[Sequence[nn.Parameter]], params: Sequence[nn.Parameter], servers: Sequence[int],
              device: torch.device, timeout_s: float, rank: int) -> set[int]:
    """Push each of ``servers``' shard gradients, wait for the replies, load the pulled parameters.

    Clears every ``.grad`` of ``params`` (the worker's own optimizer step must not move the parameters).
    Returns the servers whose reply said stop (the epoch's updates are done).
    """
    sends, replies, stopped = [], {}, set()
    for s in servers:
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in shards[s]])
        sends.append((dist.isend(grads, dst=s), grads))
        header = torch.empty(2, dtype=torch.int64, device=device)
        flat = torch.empty(grads.numel(), dtype=grads.dtype, device=grads.device)
        replies[s] = (header, flat, dist.irecv(header, src=s), dist.irecv(flat, src=s))
    for p in params:
        p.grad = None
    for s, (_, _, header_work, flat_work) in replies.items():
        for work in (header_work, flat_work):
            wait(work, timeout_s, f"worker rank {rank} waiting for server rank {s}'s reply")
    for work, _ in sends:
        work.wait()
    with torch.no_grad():
        for s, (header, flat, _, _) in replies.items():
            torch.nn.utils.vector_to_parameters(flat, shards[s])
            if header[1].item():
                stopped.add(s)
    return stopped

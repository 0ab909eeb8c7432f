"""What every data-parallel strategy shares: shards of the data, one starting point, summed gradients.

* :class:`DataParallelStrategy` — rank r trains on its own shard of each batch (``DistributedSampler``,
  reshuffled by ``set_epoch``) and evaluates on its own slice of the test set (:class:`ShardSampler`);
* :func:`broadcast_from_rank0` — every rank starts from rank 0's parameters and buffers;
* :func:`all_reduce_flat` — tensors flattened into buckets, one collective per bucket, optionally ÷ W.

DDP, the hybrid strategy and the sharded strategies (ZeRO, FSDP) build on these.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, Sampler

from labkit.collectives import all_reduce
from labkit.dist import group as kdist
from labkit.errors import ConfigError
from labkit.strategies.base import Strategy

DEFAULT_BUCKET_MB = 25.0  # DistributedDataParallel's own default bucket_cap_mb


class ShardSampler(Sampler[int]):
    """Evaluation shards without padding: rank r gets indices r, r + W, r + 2W, ...

    Unlike :class:`DistributedSampler` nothing is duplicated to even out the shards, so metrics summed
    over the ranks count every test sample exactly once.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        self.size, self.num_replicas, self.rank = len(dataset), num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.num_replicas))


class DataParallelStrategy(Strategy):
    """Each rank trains on its own shard of every batch: global batch = W × per-rank batch."""

    def __init__(self, env, options=None):
        super().__init__(env, options)
        self._samplers: list[DistributedSampler] = []

    @property
    def data_parallel_size(self) -> int:
        return self.env.world_size

    def data_shard(self) -> tuple[int, int]:
        """``(number of data shards, this rank's shard)``: one per rank here; a mesh has one per data-parallel
        coordinate (the ranks of one tensor-parallel group read the same samples)."""
        return self.env.world_size, self.env.rank

    def sampler(self, dataset: Dataset, train: bool, seed: int) -> Sampler | None:
        world, index = self.data_shard()
        if world == 1:
            return None
        if train:
            if len(dataset) < world:
                what = "ranks" if world == self.env.world_size else "data-parallel ranks"
                raise ConfigError(f"the training set has {len(dataset)} samples but the job has {world} {what}; "
                                  f"use at most {len(dataset)} ranks or more data (--train-size)")
            # drop_last: no sample is repeated to even out the shards
            sampler = DistributedSampler(dataset, num_replicas=world, rank=index, shuffle=True, seed=seed,
                                         drop_last=True)
            self._samplers.append(sampler)
            return sampler
        return ShardSampler(dataset, world, index)

    def set_epoch(self, epoch: int) -> None:
        for sampler in self._samplers:
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank


def broadcast_from_rank0(module: nn.Module) -> None:
    """Overwrite ``module``'s parameters and buffers with rank 0's (what DDP does at construction)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            kdist.broadcast(tensor, src=0)


def buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of same-dtype/device tensors, each at most ``bucket_bytes`` (or one tensor)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or (t.dtype, t.device) != (bucket[0].dtype, bucket[0].device)):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_flat(tensors: list[torch.Tensor], algorithm: str = "native",
                    bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20), average: bool = True, group=None) -> None:
    """Sum each tensor over the ranks in place (÷ W when ``average``): t ← (1/W) Σ_r t_r.

    The tensors are flattened into buckets of about ``bucket_bytes`` (one message per bucket instead of one
    per tensor); each bucket goes through ``labkit.collectives.all_reduce(flat, algorithm)``.
    """
    world = dist.get_world_size(group)
    for bucket in buckets(tensors, bucket_bytes):
        flat = torch.cat([t.reshape(-1) for t in bucket])  # (n,) the whole bucket
        all_reduce(flat, algorithm, group=group)
        if average:
            flat /= world
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def average_gradients(params: Iterable[nn.Parameter], algorithm: str = "native",
                      bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20), group=None, average: bool = True) -> None:
    """Replace every ``p.grad`` by its mean over the ranks (its sum when ``average`` is False).

    A parameter without a gradient counts as zeros, so every rank sends the same sizes.
    """
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_flat([p.grad for p in params], algorithm, bucket_bytes, average, group)

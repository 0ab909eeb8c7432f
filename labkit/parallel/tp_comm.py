"""The collectives tensor parallelism issues, in one place, each counted while a :func:`count_bytes` is open.

Counting answers seed 000's question for one FC layer ``Y = X W^T + b`` (X (B, i), W (o, i)): what does it
cost to split the batch (dim 0, data parallel) versus the features (dim 1, model parallel)?
:func:`fc_layer_bytes` gives the formulas; ``tensor_parallel.measure_fc_bytes`` counts a real step.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.dist import group as kdist


@dataclass
class CommLog:
    """Payload bytes handed to collectives while active: ``entries = [(op, where, bytes), ...]``."""

    entries: list[tuple[str, str, int]] = field(default_factory=list)

    def total(self, op: str | None = None) -> int:
        return sum(b for o, _, b in self.entries if op is None or o == op)

    def ring_wire_bytes(self, world_size: int) -> float:
        """Bytes each rank sends with ring algorithms: all-reduce ``2(p-1)/p · n``, all-gather ``(p-1) · n``
        (``n`` = the rank's own shard)."""
        p = world_size
        return sum(b * (2 * (p - 1) / p if o == "all_reduce" else p - 1) for o, _, b in self.entries)


_ACTIVE: list[CommLog] = []


@contextmanager
def count_bytes() -> Iterator[CommLog]:
    """Record every tensor-parallel collective (and :func:`all_reduce`) issued inside the block."""
    log = CommLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


def rank_world(group=None) -> tuple[int, int]:
    """(rank, world size) of ``group``; (0, 1) without a process group, where every collective is the identity."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(t: torch.Tensor, where: str = "", group=None) -> torch.Tensor:
    """Sum ``t`` over the ranks (a new tensor), logged in any active :func:`count_bytes`."""
    if rank_world(group)[1] == 1:
        return t
    out = t.contiguous().clone()
    for log in _ACTIVE:
        log.entries.append(("all_reduce", where, out.numel() * out.element_size()))
    kdist.all_reduce(out, group=group)
    return out


def all_gather_last(t: torch.Tensor, where: str, group=None) -> torch.Tensor:
    """(..., n) on each rank -> (..., p·n), rank r's block at columns ``r·n:(r+1)·n``."""
    p = rank_world(group)[1]
    if p == 1:
        return t
    t = t.contiguous()
    for log in _ACTIVE:
        log.entries.append(("all_gather", where, t.numel() * t.element_size()))
    parts = [torch.empty_like(t) for _ in range(p)]
    kdist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=-1)


def own_slice(t: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the last dimension: (..., p·n) -> (..., n)."""
    rank, p = rank_world(group)
    return t.chunk(p, dim=-1)[rank].contiguous()


def fc_layer_bytes(batch: int, in_features: int, out_features: int, world_size: int,
                   bytes_per_value: int = 4) -> dict[str, float]:
    """Seed 000's comparison for one FC layer ``Y = X W^T + b`` per training step, p = ``world_size``.

    * data parallel (split the batch, dim 0): all-reduce the gradient, ``o·i + o`` values per rank;
      ring wire bytes per rank ``2(p-1)/p · (o·i + o)``.
    * model parallel (split the features, dim 1, column-parallel + gather): forward all-gather of Y
      (each rank's shard ``B·o/p``, wire ``(p-1)·B·o/p``), backward all-reduce of dX (``B·i``, wire
      ``2(p-1)/p · B·i``).

    Data parallel moves parameters; model parallel moves activations: FC layers (many weights, small
    activations) favour model parallel, convolutions (few weights, big activations) data parallel.
    """
    p, s = world_size, bytes_per_value
    dp_payload = (out_features * in_features + out_features) * s
    mp_gather, mp_reduce = batch * out_features // p * s, batch * in_features * s
    return {"data_parallel_payload": dp_payload, "data_parallel_wire": 2 * (p - 1) / p * dp_payload,
            "model_parallel_payload": mp_gather + mp_reduce,
            "model_parallel_wire": (p - 1) * mp_gather + 2 * (p - 1) / p * mp_reduce}

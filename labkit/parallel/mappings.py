"""Tensor parallelism's conjugate operators, each a :class:`torch.autograd.Function`, and the collectives they issue,
each counted while a :func:`count_bytes` is open.

A tensor-parallel group of ``t`` ranks splits a layer's matrices (:mod:`labkit.parallel.layers`: the GPT's blocks in
:mod:`labkit.parallel.megatron`, an MLP's ``Linear`` pairs in :mod:`labkit.parallel.tp`). Where the activations
cross from "every rank holds the same tensor" to "each rank holds a part" and back, one operator and its conjugate
(the same collective moved to the other pass) keep forward and backward exact (Shoeybi et al. 2019, "Megatron-LM",
§3; Korthikanti et al. 2022, "Reducing Activation Recomputation", §4.2):

===============================  ===================================  =========================================
operator                         forward                              backward
===============================  ===================================  =========================================
``f``: :func:`copy_to_tp`        identity: ``Y = X``                  all-reduce: ``dX = Σ_r dY_r``
``g``: :func:`reduce_from_tp`    all-reduce: ``Y = Σ_r X_r``          identity: ``dX_r = dY``
:func:`gather_from_tp`           all-gather of the last dim:          this rank's slice of dY:
                                 ``(..., n/t) -> (..., n)``           ``dX_r = dY[..., r·n/t:(r+1)·n/t]``
:func:`scatter_to_tp`            this rank's slice of the last dim:   all-gather of the last dim:
                                 ``(..., n) -> (..., n/t)``           ``(..., n/t) -> (..., n)``
SP ``g``: :func:`gather_sequence`  all-gather along the sequence:     reduce-scatter along the sequence:
                                 ``(B, T/t, C) -> (B, T, C)``         ``dX_r = (Σ_q dY_q)[:, r·T/t:(r+1)·T/t]``
SP ``ḡ``: :func:`scatter_sequence`  reduce-scatter along the sequence: all-gather along the sequence:
                                 ``(B, T, C) -> (B, T/t, C)``, summed ``(B, T/t, C) -> (B, T, C)``
===============================  ===================================  =========================================

``f`` enters a column-parallel layer (every rank needs all of X; each rank's ``dY_r W_r`` is a part of dX),
``g`` leaves a row-parallel layer (each rank holds a partial sum of Y). With sequence parallelism (Korthikanti's
``g`` and ``ḡ``) the replicated (B, T, C) activations between the layers are cut along the sequence instead:
an all-reduce is a reduce-scatter followed by an all-gather, so ``f``/``g`` become the all-gather /
reduce-scatter pair above and the same bytes cross the wire while the layer norms and dropout in between work
on T/t tokens. Expert parallelism's exchange of rows between the ranks holding the experts, an all-to-all whose
backward is the all-to-all back (:class:`AllToAll`, :mod:`labkit.parallel.ep`), is the same kind of operator.

Bytes: each collective logs ``(op, where, payload bytes)`` in every open :class:`CommLog`, ``where`` the pass
("forward" / "backward") or the caller's label; :meth:`CommLog.ring_wire_bytes` turns the payloads into the bytes a
rank sends with ring algorithms. On a group of one rank every operator is the identity and nothing is logged. The
collectives go through :mod:`labkit.dist.group`'s helpers (the tensor is moved to the group's communication
device); the reduce-scatter (:func:`labkit.dist.group.reduce_scatter_tensor`, which takes the tensors where they
are) gets its tensor moved here the same way.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.dist import group as kdist

# ----- counting ------------------------------------------------------------------------------------------


@dataclass
class CommLog:
    """Payload bytes handed to collectives while active: ``entries = [(op, where, bytes), ...]``."""

    entries: list[tuple[str, str, int]] = field(default_factory=list)

    def total(self, op: str | None = None) -> int:
        return sum(b for o, _, b in self.entries if op is None or o == op)

    def ring_wire_bytes(self, world_size: int) -> float:
        """Bytes each rank sends with ring algorithms: all-reduce ``2(p-1)/p · n`` (``n`` its input), all-gather
        ``(p-1) · n`` (``n`` the rank's own shard), reduce-scatter ``(p-1)/p · n`` (``n`` its whole input);
        all-to-all ``n`` (logged as the bytes it sends to other ranks)."""
        p = world_size
        factor = {"all_reduce": 2 * (p - 1) / p, "all_gather": p - 1, "reduce_scatter": (p - 1) / p, "all_to_all": 1}
        return sum(b * factor[o] for o, _, b in self.entries)


_ACTIVE: list[CommLog] = []


@contextmanager
def count_bytes() -> Iterator[CommLog]:
    """Record every collective of this module issued inside the block."""
    log = CommLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


def _log(op: str, where: str, t: torch.Tensor) -> None:
    for log in _ACTIVE:
        log.entries.append((op, where, t.numel() * t.element_size()))


# ----- the group and its collectives ---------------------------------------------------------------------


def group_size(group) -> int:
    """Ranks in ``group`` (1 without a process group: every operator is then the identity)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_reduce_copy(x: torch.Tensor, group=None, op=dist.ReduceOp.SUM, where: str = "") -> torch.Tensor:
    """A new tensor: ``x`` reduced (``op``, default sum) over ``group``; ``x`` itself on one rank.
    Payload ``n`` = x's bytes, ring wire ``2(t-1)/t · n``."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    _log("all_reduce", where, out)
    return kdist.all_reduce(out, op=op, group=group)


def _all_gather(x: torch.Tensor, dim: int, where: str, group) -> torch.Tensor:
    """Each rank's ``x`` concatenated along ``dim`` in rank order. Payload ``n`` = x's bytes, ring wire ``(t-1)·n``."""
    x = x.contiguous()
    _log("all_gather", where, x)
    parts = kdist.all_gather([torch.empty_like(x) for _ in range(group_size(group))], x, group=group)
    return torch.cat(parts, dim=dim)


def _own_slice(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of the last dimension: (..., n) -> (..., n/t). No communication."""
    return x.chunk(group_size(group), dim=-1)[group_rank(group)].contiguous()


def _reduce_scatter_sequence(x: torch.Tensor, where: str, group) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/t, C) part of their sum. Payload ``n`` = x's bytes
    (the whole input), ring wire ``(t-1)/t · n``.

    The reduce-scatter splits its input along dim 0, so the sequence dim is moved first:
    (B, T, C) -> (t, B, T/t, C) (rank q's slice of positions at index q), flattened.
    """
    t = group_size(group)
    B, T, C = x.shape
    chunks = x.reshape(B, t, T // t, C).transpose(0, 1).reshape(-1)  # (t, B, T/t, C), flat
    _log("reduce_scatter", where, chunks)
    device = kdist.comm_device(group)
    out = torch.empty(B * (T // t) * C, dtype=x.dtype, device=device)
    kdist.reduce_scatter_tensor(out, chunks.to(device), group=group)
    return out.view(B, T // t, C).to(x.device)


# ----- the operators -------------------------------------------------------------------------------------


class CopyToTensorParallel(torch.autograd.Function):
    """``f``: forward ``Y = X`` (each rank's column shard needs the whole input), backward ``dX = Σ_r dY_r``
    (rank r's ``dY_r = dZ_r W_r`` is only its shard's contribution to the input's gradient).
    Bytes: none forward; backward an all-reduce of dX's bytes, wire ``2(t-1)/t`` times that."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.group, where="backward"), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """``g``: forward ``Y = Σ_r X_r`` (rank r's row shard gives the partial product ``X_r W_rᵀ``), backward
    ``dX_r = dY`` (a sum passes its gradient unchanged to every term).
    Bytes: forward an all-reduce of Y's bytes, wire ``2(t-1)/t`` times that; none backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_copy(x, group, where="forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """Forward all-gather of the last dimension's slices, ``(..., n/t) -> (..., n)``, rank r's at columns
    ``r·n/t:(r+1)·n/t``; backward keeps this rank's slice of dY (every rank holds the whole dY).
    Bytes: forward an all-gather of X's bytes (the shard), wire ``(t-1)`` times that; none backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, "forward", group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group), None


class ScatterToTensorParallel(torch.autograd.Function):
    """Forward keeps this rank's slice of the last dimension, ``(..., n) -> (..., n/t)``; backward all-gathers
    the slices of dX. Bytes: none forward; backward an all-gather of the shard dY, wire ``(t-1)`` times that."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, "backward", ctx.group), None


class GatherSequence(torch.autograd.Function):
    """Sequence parallel ``g``: forward all-gather of the sequence shards (B, T/t, C) -> (B, T, C); backward
    reduce-scatter: the gradient of rank r's shard is the sum over ranks of their (B, T, C) gradients at r's
    positions (every rank used the whole gathered tensor).
    Bytes: forward an all-gather of the (B, T/t, C) shard; backward a reduce-scatter of the (B, T, C) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, "forward", group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, "backward", ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel ``ḡ``: forward reduce-scatter (B, T, C) partial sums -> this rank's (B, T/t, C) part of
    the sum; backward all-gather: each rank's partial sum contributed to every position, so each gets the
    whole (B, T, C) gradient, gathered from the shards.
    Bytes: forward a reduce-scatter of the (B, T, C) input; backward an all-gather of the (B, T/t, C) shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, "forward", group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, "backward", ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``f`` (see :class:`CopyToTensorParallel`)."""
    return x if group_size(group) == 1 else CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``g`` (see :class:`ReduceFromTensorParallel`)."""
    return x if group_size(group) == 1 else ReduceFromTensorParallel.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather forward / slice backward along the last dim (see :class:`GatherFromTensorParallel`)."""
    return x if group_size(group) == 1 else GatherFromTensorParallel.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Slice forward / all-gather backward along the last dim (see :class:`ScatterToTensorParallel`)."""
    return x if group_size(group) == 1 else ScatterToTensorParallel.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather forward / reduce-scatter backward along dim 1 (see :class:`GatherSequence`)."""
    return x if group_size(group) == 1 else GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter forward / all-gather backward along dim 1 (see :class:`ReduceScatterSequence`)."""
    return x if group_size(group) == 1 else ReduceScatterSequence.apply(x, group)


class AllToAll(torch.autograd.Function):
    """Expert parallelism's exchange of rows (R, C) by ``all_to_all_single``: ``send[j]`` rows to rank j, ``recv[j]``
    rows from it, ``(Σ_j send[j], C) -> (Σ_j recv[j], C)``; backward sends the gradients back the other way (the
    splits swapped), ``dX = exchange(dY; send ↔ recv)``. Bytes: ``(Σ_{j≠rank} send[j]) · C · b`` sent to other
    ranks each way, added to ``counter`` (a dict: ``rows``, ``bytes``) and logged as ``all_to_all``."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv: list[int], send: list[int], group, rank: int, counter: dict):
        ctx.recv, ctx.send, ctx.group, ctx.rank, ctx.counter = recv, send, group, rank, counter
        return _exchange(rows, recv, send, group, rank, counter, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = _exchange(grad, ctx.send, ctx.recv, ctx.group, ctx.rank, ctx.counter, "backward")
        return out, None, None, None, None, None


def _exchange(rows, recv, send, group, rank, counter, where) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    kdist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    remote = sum(send) - send[rank]
    sent = remote * math.prod(rows.shape[1:]) * rows.element_size()
    counter["rows"] += remote
    counter["bytes"] += sent
    for log in _ACTIVE:
        log.entries.append(("all_to_all", where, sent))
    return out


# ----- which rows are this rank's ------------------------------------------------------------------------


def part(n: int, t: int, r: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``r``'s part of ``n`` rows over ``t`` ranks: ``torch.tensor_split``'s parts, so
    when ``t`` does not divide ``n`` the first ``n mod t`` ranks hold one row more (103 tokens over 2: 52, 51)."""
    q, extra = divmod(n, t)
    start = r * q + min(r, extra)
    return start, start + q + (r < extra)


def split_range(n: int, group) -> tuple[int, int]:
    """This rank's :func:`part` of ``n`` rows over ``group``."""
    return part(n, group_size(group), group_rank(group))


def sequence_shard(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous ``1/t`` of ``x`` along ``dim`` (no communication)."""
    t = group_size(group)
    return x if t == 1 else x.chunk(t, dim=dim)[group_rank(group)]

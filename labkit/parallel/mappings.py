"""The four conjugate operators of Megatron tensor parallelism, each a :class:`torch.autograd.Function`.

A tensor-parallel group of ``t`` ranks splits a transformer block's matrices (:mod:`labkit.parallel.megatron`).
Where the activations cross from "every rank holds the same tensor" to "each rank holds a part" and back, one
operator and its conjugate (the same collective moved to the other pass) keep forward and backward exact
(Shoeybi et al. 2019, "Megatron-LM", §3; Korthikanti et al. 2022, "Reducing Activation Recomputation", §4.2):

============================  ======================================  ==========================================
operator                      forward                                 backward
============================  ======================================  ==========================================
``f``: copy_to_tp             identity: ``Y = X``                     all-reduce: ``dX = Σ_r dY_r``
``g``: reduce_from_tp         all-reduce: ``Y = Σ_r X_r``             identity: ``dX_r = dY``
SP ``g``: gather_sequence     all-gather along the sequence:          reduce-scatter along the sequence:
                              ``(B, T/t, C) -> (B, T, C)``            ``dX_r = (Σ_q dY_q)[:, r·T/t:(r+1)·T/t]``
SP ``ḡ``: scatter_sequence    reduce-scatter along the sequence:      all-gather along the sequence:
                              ``(B, T, C) -> (B, T/t, C)``, summed    ``(B, T/t, C) -> (B, T, C)``
============================  ======================================  ==========================================

``f`` enters a column-parallel layer (every rank needs all of X; each rank's ``dY_r W_r`` is a part of dX),
``g`` leaves a row-parallel layer (each rank holds a partial sum of Y). With sequence parallelism (Korthikanti's
``g`` and ``ḡ``) the replicated (B, T, C) activations between the layers are cut along the sequence instead:
an all-reduce is a reduce-scatter followed by an all-gather, so ``f``/``g`` become the all-gather /
reduce-scatter pair above and the same bytes cross the wire while the layer norms and dropout in between work
on T/t tokens.

On a group of one rank every operator is the identity. The collectives go through :mod:`labkit.dist.group`'s helpers
(the tensor is moved to the group's communication device); the reduce-scatter, which :mod:`labkit.dist.group` lacks,
is done here the same way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.dist import group as kdist


def group_size(group) -> int:
    """Ranks in ``group`` (1 without a process group: every operator is then the identity)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_reduce_copy(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A new tensor: ``x`` reduced (``op``, default sum) over ``group``."""
    return kdist.all_reduce(x.contiguous().clone(), op=op, group=group)


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, C) on each rank -> (B, T, C), rank r's part at positions ``r·T/t:(r+1)·T/t``."""
    x = x.contiguous()
    parts = kdist.all_gather([torch.empty_like(x) for _ in range(group_size(group))], x, group=group)
    return torch.cat(parts, dim=1)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/t, C) part of their sum.

    ``dist.reduce_scatter_single`` splits its input along dim 0, so the sequence dim is moved first:
    (B, T, C) -> (t, B, T/t, C) (rank q's slice of positions at index q), flattened.
    """
    t = group_size(group)
    B, T, C = x.shape
    chunks = x.reshape(B, t, T // t, C).transpose(0, 1).reshape(-1)  # (t, B, T/t, C), flat
    device = kdist.comm_device(group)
    out = torch.empty(B * (T // t) * C, dtype=x.dtype, device=device)
    dist.reduce_scatter_single(out, chunks.to(device), group=group)
    return out.view(B, T // t, C).to(x.device)


class CopyToTensorParallel(torch.autograd.Function):
    """``f``: forward ``Y = X`` (each rank's column shard needs the whole input), backward ``dX = Σ_r dY_r``
    (rank r's ``dY_r = dZ_r W_r`` is only its shard's contribution to the input's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """``g``: forward ``Y = Σ_r X_r`` (rank r's row shard gives the partial product ``X_r W_rᵀ``), backward
    ``dX_r = dY`` (a sum passes its gradient unchanged to every term)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSequence(torch.autograd.Function):
    """Sequence parallel ``g``: forward all-gather of the sequence shards (B, T/t, C) -> (B, T, C); backward
    reduce-scatter: the gradient of rank r's shard is the sum over ranks of their (B, T, C) gradients at r's
    positions (every rank used the whole gathered tensor)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel ``ḡ``: forward reduce-scatter (B, T, C) partial sums -> this rank's (B, T/t, C) part of
    the sum; backward all-gather: each rank's partial sum contributed to every position, so each gets the
    whole (B, T, C) gradient, gathered from the shards."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``f`` (see :class:`CopyToTensorParallel`)."""
    return x if group_size(group) == 1 else CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``g`` (see :class:`ReduceFromTensorParallel`)."""
    return x if group_size(group) == 1 else ReduceFromTensorParallel.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather forward / reduce-scatter backward along dim 1 (see :class:`GatherSequence`)."""
    return x if group_size(group) == 1 else GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter forward / all-gather backward along dim 1 (see :class:`ReduceScatterSequence`)."""
    return x if group_size(group) == 1 else ReduceScatterSequence.apply(x, group)


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

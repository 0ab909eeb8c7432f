"""Tensor parallelism's four region boundaries, each an autograd Function with its matching backward:
where a column-parallel layer's input enters the ranks (copy), where a row-parallel layer's partial sums
leave them (reduce), and where slices of the last dimension are gathered or scattered.

    y = reduce_from_parallel_region(F.linear(x_slice, w_slice), group)   # (B, o): Σ_r X_r W_r^T
"""
from __future__ import annotations

import torch

from labkit.parallel.tp_comm import all_gather_last, all_reduce, own_slice


class _CopyToParallel(torch.autograd.Function):
    """Forward identity (X enters every rank's slice); backward all-reduce (dX = Σ_r dY_r W_r)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, "backward", ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """Forward all-reduce (Y = Σ_r X_r W_r^T); backward identity (every partial sum gets the whole dY)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, "forward", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """Forward all-gather of column slices; backward keeps this rank's slice of dY."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last(x, "forward", group)

    @staticmethod
    def backward(ctx, grad):
        return own_slice(grad, ctx.group), None


class _ScatterToParallel(torch.autograd.Function):
    """Forward keeps this rank's slice of X; backward all-gathers the slices of dX."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last(grad, "backward", ctx.group), None


def copy_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, group)


def gather_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherFromParallel.apply(x, group)


def scatter_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ScatterToParallel.apply(x, group)

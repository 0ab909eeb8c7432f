"""Tensor parallelism's layers: a dense ``nn.Linear`` split over the ranks of a group, the one pair the GPT
(:mod:`labkit.parallel.megatron`) and the CNN/MLP ``Linear`` pairs (:func:`labkit.parallel.tp.parallelize_linears`)
both use.

A linear layer ``Y = X Wᵀ + b`` with ``W (out, in)`` splits over ``t`` ranks two ways (Shoeybi et al. 2019):

* column-parallel: rank r keeps rows ``W_r = W[r·out/t:(r+1)·out/t]`` and computes its slice of the output
  features, ``Y_r = X W_rᵀ + b_r``, from the whole X;
* row-parallel: rank r keeps columns ``W[:, r·in/t:(r+1)·in/t]``, takes its slice of the input features and
  computes a partial sum ``X_r W_rᵀ``; ``Y = Σ_r X_r W_rᵀ + b``.

A column layer feeds a row layer with no communication between them: the pair costs the operator ``f`` before it
and ``g`` after it (:mod:`labkit.parallel.mappings`), one all-reduce forward and one backward. When ``t`` does not
divide the split dimension the parts differ by one row (:func:`~labkit.parallel.mappings.part`); gathering or
scattering the last dimension needs equal parts.

``rank`` / ``world_size`` pick a part without a process group (then every operator is the identity): one process
can build every rank's slice of a layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.mappings import (
    copy_to_tp,
    gather_from_tp,
    gather_sequence,
    group_rank,
    group_size,
    part,
    reduce_from_tp,
    scatter_sequence,
    scatter_to_tp,
)


def shard_rows(w: torch.Tensor, group, rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    """A copy of this rank's :func:`~labkit.parallel.mappings.part` of ``w``'s rows (dim 0)."""
    t = group_size(group) if world_size is None else world_size
    start, stop = part(w.shape[0], t, group_rank(group) if rank is None else rank)
    return w.detach()[start:stop].clone()


def mark_sequence_parallel(p: nn.Parameter) -> nn.Parameter:
    """Mark ``p`` as used on a sequence shard: its gradient is summed over the tp group
    (:func:`labkit.parallel.megatron.sync_sequence_parallel_grads`)."""
    p.sequence_parallel = True
    return p


def _even(features: int, world_size: int, what: str) -> None:
    if features % world_size:
        raise ConfigError(f"{what} has {features} features, not divisible by world size {world_size}; "
                          f"run on a number of ranks that divides {features}")


class EnterTensorParallel(nn.Module):
    """Where a replicated activation enters a column-parallel layer: ``f`` (identity forward, all-reduce
    backward); with sequence parallelism the all-gather of the sequence, (B, T/t, C) -> (B, T, C)."""

    def __init__(self, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)


class ColumnParallelLinear(nn.Linear):
    """Rank r's rows of a full ``nn.Linear``: (..., in) -> (..., out/t), the same function once the slices are
    side by side.

    Args:
        linear: the dense layer, the same on every rank.
        enter: apply ``f`` to the input here (:class:`EnterTensorParallel`); else the input must already have
            entered the parallel region (the GPT's :class:`~labkit.parallel.megatron.ParallelInputLayerNorm`).
        gather_output: all-gather the slices into the whole (..., out) (needs ``t`` to divide ``out``).
        rank, world_size: default to ``group``'s.
    """

    def __init__(self, linear: nn.Linear, group=None, enter: bool = False, sequence_parallel: bool = False,
                 gather_output: bool = False, rank: int | None = None, world_size: int | None = None):
        if gather_output:
            _even(linear.out_features, group_size(group) if world_size is None else world_size,
                  "column-parallel Linear output")
        weight = shard_rows(linear.weight, group, rank, world_size)                      # (out/t, in)
        super().__init__(linear.in_features, weight.shape[0], bias=linear.bias is not None)
        self.weight = nn.Parameter(weight)
        if linear.bias is not None:
            self.bias = nn.Parameter(shard_rows(linear.bias, group, rank, world_size))   # (out/t,)
        self.enter = EnterTensorParallel(group, sequence_parallel) if enter else nn.Identity()
        self.group, self.gather_output = group, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.enter(x), self.weight, self.bias)                              # (..., out/t)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Linear):
    """Rank r's columns of a full ``nn.Linear``: (..., in/t) -> (..., out), the partial products summed by ``g``
    (all-reduce), or reduce-scattered along the sequence with sequence parallelism. The bias is whole on every rank
    and added once, after the sum (with SP on the (B, T/t, out) shard, so its gradient is marked for the group sum).

    Args:
        input_is_parallel: the input is already this rank's slice (..., in/t), as a column layer produces; else the
            whole (..., in) is sliced here (needs ``t`` to divide ``in``).
        rank, world_size: default to ``group``'s.
    """

    def __init__(self, linear: nn.Linear, group=None, sequence_parallel: bool = False, input_is_parallel: bool = True,
                 rank: int | None = None, world_size: int | None = None):
        if not input_is_parallel:
            _even(linear.in_features, group_size(group) if world_size is None else world_size,
                  "row-parallel Linear input")
        weight = shard_rows(linear.weight.t(), group, rank, world_size).t().contiguous()  # (out, in/t)
        super().__init__(weight.shape[1], linear.out_features, bias=linear.bias is not None)
        self.weight = nn.Parameter(weight)
        if linear.bias is not None:
            bias = nn.Parameter(linear.bias.detach().clone())                              # (out,) replicated
            self.bias = mark_sequence_parallel(bias) if sequence_parallel else bias
        self.group, self.sequence_parallel, self.input_is_parallel = group, sequence_parallel, input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)                                             # (..., in/t)
        y = F.linear(x, self.weight)                                                     # (..., out) partial
        y = scatter_sequence(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias                                 # (B, T or T/t, out)

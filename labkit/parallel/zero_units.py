"""ZeRO's flat parameter buffers: a :class:`Unit` per module that owns parameters (rank r's shard of its padded
flat buffer, gathered and freed as :class:`~labkit.parallel.zero_sharding.ZeroSharding` needs it), and
:class:`Comm`, the all-gathers and reduce-scatters over one process group with the bytes each rank sends counted.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from labkit.dist import group as kdist


class Unit:
    """One module's parameters as a flat buffer of N·S elements, of which rank r owns elements [r·S, (r+1)·S).

    ``full`` (N·S,) holds the gathered parameters (the module's parameters are views into it); ``shard``
    (S,) is what this rank's optimizer steps; ``grad`` (S,) this rank's slice of the averaged gradient.
    ``params``: the module's own trainable parameters unless given (a parameter it shares with a module that
    has its unit already left out). With ``keep_full_grad`` (stage 1) the gradients live in a persistent flat (N·S,) buffer, the
    parameters' ``.grad`` are views into it and ``grad`` is its slice.
    """

    def __init__(self, module: nn.Module, world: int, rank: int, comm: Comm, keep_full_grad: bool,
                 params: list[nn.Parameter] | None = None):
        self.module, self.comm, self.rank = module, comm, rank
        self.params = params if params is not None else [p for p in module.parameters(recurse=False)
                                                         if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.size = math.ceil(self.numel / world)  # S
        first = self.params[0]
        self.full = torch.zeros(self.size * world, dtype=first.dtype, device=first.device)  # (N·S,)
        offset = 0
        for p in self.params:
            self.full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.slice = slice(rank * self.size, (rank + 1) * self.size)
        self.shard = nn.Parameter(self.full[self.slice])  # (S,) a view: stepping it updates `full`
        self.full_grad = torch.zeros_like(self.full) if keep_full_grad else None  # (N·S,) stage 1
        self.grad = self.full_grad[self.slice] if keep_full_grad else torch.zeros_like(self.shard.detach())  # (S,)
        self.pending = len(self.params)
        self.gathered, self.handle = True, None

    def shard_own_storage(self) -> None:
        """Stage 3: the shard becomes its own (S,) tensor and the full buffer is freed."""
        self.shard.data = self.full[self.slice].clone()
        self.free()

    def free(self) -> None:
        """Release the gathered parameters' memory; the parameter views keep their shapes for the next gather."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def zero_grad(self) -> None:
        """Stage 1: zero the flat gradient buffer; backward accumulates into the parameters' views of it."""
        self.full_grad.zero_()
        offset = 0
        for p in self.params:
            p.grad = self.full_grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def gather(self, wait: bool = True, force: bool = False) -> None:
        """All-gather every rank's shard into ``full`` (asynchronously if ``wait`` is False).

        ``force``: gather even though ``full`` is allocated (stages 1 and 2 after each optimizer step).
        """
        if not self.gathered or force:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            self.handle = self.comm.all_gather(self.full, self.shard.detach().clone(), async_op=not wait)
            self.gathered = True
        if wait and self.handle is not None:
            self.handle.wait()
            self.handle = None

    def reduce_gradients(self) -> None:
        """g_shard ← (1/N) Σ_r g_r[r·S:(r+1)·S]: reduce-scatter the flat gradient; free the full gradients."""
        if self.full_grad is not None:  # stage 1: the gradients already sit in the flat buffer
            mine = torch.empty_like(self.grad)
            self.comm.reduce_scatter(mine, self.full_grad)
            self.grad.copy_(mine)
        else:
            flat = self.full.new_zeros(self.full.numel())  # (N·S,) padding stays 0
            offset = 0
            for p in self.params:
                if p.grad is not None:  # an unused parameter contributes zeros
                    flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                offset += p.numel()
                p.grad = None  # the full gradient is freed: only this rank's slice stays
            self.comm.reduce_scatter(self.grad, flat)
        self.grad /= self.comm.world
        self.shard.grad = self.grad
        self.pending = len(self.params)


class Comm:
    """The strategy's collectives over ``group`` of N = ``world`` ranks (``None``: the whole job), counting the
    bytes each rank sends (ring algorithms: (N−1)/N of the buffer).

    ``world`` must be ``group``'s size; ``distributed`` False: one process, the collectives are copies.
    """

    def __init__(self, world: int, distributed: bool, group=None):
        self.world, self.distributed, self.group = world, distributed, group
        self.sent_bytes = 0

    def _count(self, full: torch.Tensor) -> None:
        self.sent_bytes += (self.world - 1) * full.numel() * full.element_size() // self.world

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        self._count(full)
        if not self.distributed:
            full.copy_(shard)
            return None
        return kdist.all_gather_into_tensor(full, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self._count(full)
        if not self.distributed:
            shard.copy_(full)
            return
        kdist.reduce_scatter_tensor(shard, full, group=self.group)

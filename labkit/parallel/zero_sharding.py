"""ZeRO's stages applied to one model over one process group: the :class:`~labkit.parallel.zero_units.Unit` of
each module, the hooks that reduce-scatter gradients (stage 2, 3) and gather parameters (stage 3), and the step's
end (all-gather the stepped shards).

The mesh's ``dp`` dimension (:mod:`labkit.parallel.dp`, ``--dp-shard zero1|zero2|zero3``, and ``--strategy zero``,
its preset over every rank) shards over its ``dp`` group of N ranks, each rank r of it owning elements
``[r·S, (r+1)·S)`` of every unit's flat buffer of N·S elements.

Per step (N ranks of the group, P elements of padded flat buffers, ring collectives): a reduce-scatter of the
gradients and an all-gather of the parameters, ``2 (N − 1)/N · P`` sent (stage 3: one more all-gather,
``3 (N − 1)/N · P``). Nothing else: no host sync.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from labkit.parallel.zero_units import Comm, Unit


class ZeroSharding:
    """ZeRO stage 1, 2 or 3 of one model over ``comm``'s group.

    Args:
        stage: 1 optimizer state, 2 + gradients, 3 + parameters.
        comm: the group's collectives (:class:`~labkit.parallel.zero_units.Comm`, ``comm.world`` = N).
        rank: this rank's index in the group.
        prefetch: stage 3: gather the next unit's parameters while this one computes.
        reduce_in_backward: stages 2, 3 reduce-scatter a unit's gradient as soon as backward has made it; False
            (a pipeline, whose micro-batches accumulate into the gradients): after backward, in
            :meth:`sync_gradients`, as stage 1 does.
    """

    def __init__(self, stage: int, comm: Comm, rank: int, prefetch: bool = False, reduce_in_backward: bool = True):
        self.stage, self.comm, self.rank, self.prefetch = stage, comm, rank, prefetch
        self.reduce_in_backward = reduce_in_backward and stage >= 2
        self.units: list[Unit] = []

    def shard(self, model: nn.Module) -> None:
        """One unit per module owning trainable parameters (a parameter shared by two modules, such as a tied
        embedding and head, belongs to the first); the hooks of the stage."""
        claimed: set[int] = set()
        for m in model.modules():
            params = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in claimed]
            if params:
                claimed.update(id(p) for p in params)
                self.units.append(Unit(m, self.comm.world, self.rank, self.comm, self.stage == 1, params))
        for i, unit in enumerate(self.units):
            if self.reduce_in_backward:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))
            if self.stage == 3:
                unit.shard_own_storage()
                unit.module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
                unit.module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    # ----- the step ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Before forward: stage 1's flat gradient buffers zeroed, the parameters' ``.grad`` views into them."""
        if self.stage == 1:
            for unit in self.units:
                unit.zero_grad()

    def _before_forward(self, i: int) -> None:
        self.units[i].gather()
        if self.prefetch and i + 1 < len(self.units):
            self.units[i + 1].gather(wait=False)

    def _after_forward(self, i: int, out) -> None:
        self.units[i].free()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self.units[i].gather()
        if self.prefetch and i > 0:
            self.units[i - 1].gather(wait=False)

    def _grad_ready(self, unit: Unit) -> None:
        unit.pending -= 1
        if unit.pending == 0:  # the unit's whole gradient exists: reduce-scatter it now, inside backward
            unit.reduce_gradients()
            if self.stage == 3:
                unit.free()

    def sync_gradients(self) -> None:
        """After backward: reduce-scatter what backward has not (stage 1, no hooks, a unit with unused
        parameters); stage 3 frees what is still gathered."""
        for unit in self.units:
            if not self.reduce_in_backward or unit.pending != len(unit.params):
                unit.reduce_gradients()
            if self.stage == 3 and unit.gathered:
                unit.gather()  # wait for a prefetch still in flight before freeing
                unit.free()

    def after_step(self, optimizer, args, kwargs) -> None:
        """The optimizer's step post-hook: stages 1, 2 all-gather the stepped shards (stage 3 gathers at the
        next forward); the shards' gradients dropped."""
        if self.stage < 3:
            for unit in self.units:
                unit.gather(force=True)
        for unit in self.units:
            unit.shard.grad = None

    def build_optimizer(self, spec):
        """``spec``'s optimizer over this rank's shards only (its state: K·Ψ/N), gathering after each step."""
        optimizer, preconditioner = spec.build(nn.ParameterList([u.shard for u in self.units]))
        optimizer.register_step_post_hook(self.after_step)
        return optimizer, preconditioner

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole for the block (stage 3: the freed units all-gathered, and after the block their
        shards set from what it left in them, e.g. a checkpoint loaded, and freed again)."""
        freed = [unit for unit in self.units if not unit.gathered]
        for unit in freed:
            unit.gather()
        try:
            yield
        finally:
            with torch.no_grad():
                for unit in freed:
                    unit.shard.copy_(unit.full[unit.slice])
                    unit.free()

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter, whole, on every rank of the group (all-gathered for stage 3)."""
        with self.gathered():
            return [p.detach().clone() for unit in self.units for p in unit.params]

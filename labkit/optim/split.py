r"""Split a whole-matrix optimizer over the data-parallel ranks: each rank owns some parameters, steps only those,
and the stepped parameters travel from their owners to every rank.

Under data parallelism every rank holds the same averaged gradient, so every rank could run the optimizer on
every parameter, and Shampoo's, SOAP's or Muon's per-matrix work (eigendecompositions, Newton–Schulz) and
state would be repeated W times. Instead parameter i gets one *owner* o_i
(:func:`labkit.optim.kfac.distributed.assign_owners`: largest cost first, each to the least-loaded rank, the
rule K-FAC uses for its decompositions), and per step, in the order :meth:`OwnerSplit.share` codes it::

    on rank o_i only      state_i, W_i ← optimizer(state_i, W_i, ∇W_i)      work and state: 1/W of the total
    every rank            W_i ← broadcast(W_i, src=o_i), one broadcast per owner rank, its parameters packed

That is ZeRO-1's pattern (the optimizer state sharded, the parameters all-gathered after the step: Moonlight's
distributed Muon) and, for Shampoo, the per-group workers of distributed Shampoo with the search direction
replaced by the stepped parameter (the same bytes). Per step, with ``s`` bytes per number and parameters of
``n_i`` numbers (payload bytes of the broadcasts; 0 on one rank)::

    communication         s Σ_i n_i                     every parameter leaves its owner once
    optimizer state       Σ_{i: o_i = r} state bytes_i   on rank r (see :func:`state_bytes`)

A rank that held a different model (a pipeline stage) would wait in a broadcast its peers never join, and a
tensor-parallel shard would be overwritten by another rank's shard of the same shape, so :class:`OwnerSplit`
compares every parameter's shape and sum once, when it is built (replicas start equal), and raises
:class:`~labkit.errors.ConfigError` on every rank alike.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from labkit.errors import CheckpointError, ConfigError
from labkit.optim.kfac.distributed import assign_owners, broadcast_from_owners


class OwnerSplit:
    """Who steps which parameter, and the broadcasts that share the stepped parameters.

    Args:
        params: every parameter the optimizer steps, in one fixed order (the same on every rank).
        costs: the work per parameter that :func:`assign_owners` balances.
        name: the optimizer's name, for the error message.
        distributed: split over the default process group; ``None``: when one with several ranks is running.

    Attributes:
        world_size, rank: the split's (1 and 0 on one process).
        owners: owner rank of each parameter.
        bytes_sent: payload bytes of the broadcasts so far.
    """

    def __init__(self, params: Sequence[Tensor], costs: Sequence[float], name: str, distributed: bool | None = None):
        running = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        distributed = running if distributed is None else distributed and running
        self.params, self.costs = list(params), list(costs)
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.owners = assign_owners(self.costs, self.world_size)
        self.bytes_sent = 0
        if self.world_size > 1:
            # shapes and sums: equal shapes with other values are tensor-parallel shards, as wrong to share
            mine = [(tuple(p.shape), float(p.detach().double().sum())) for p in self.params]
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
            if any(s != mine for s in gathered):
                raise ConfigError(f"--optimizer {name} splits its work over the data-parallel ranks and needs the "
                                  "whole model on every rank (--strategy single or ddp), but the ranks hold different "
                                  "parameters")

    def mine(self, index: int) -> bool:
        """Does this rank step parameter ``index``?"""
        return self.owners[index] == self.rank

    def share(self) -> int:
        """Every parameter from its owner to every rank (in place); returns and counts the payload bytes."""
        if self.world_size == 1:
            return 0
        with torch.no_grad():
            sent = broadcast_from_owners([[p.data] for p in self.params], self.owners)
        self.bytes_sent += sent
        return sent

    def communication_per_step(self, world_size: int | None = None) -> int:
        """Payload bytes of :meth:`share` on ``world_size`` ranks (default: this split's), from the shapes:
        ``s Σ_i n_i`` (0 on one rank)."""
        if (self.world_size if world_size is None else world_size) == 1:
            return 0
        return sum(p.numel() * p.element_size() for p in self.params)

    def state_bytes_per_rank(self, optimizer: torch.optim.Optimizer, world_size: int) -> list[int]:
        """The optimizer-state bytes each of ``world_size`` ranks would hold: the state of the parameters it would own
        (this process's state, every parameter's, divided by the owners :func:`assign_owners` gives on that many)."""
        per_param = {}
        for part in getattr(optimizer, "parts", [optimizer]):
            for p, state in part.state.items():
                per_param[id(p)] = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))
        held = [0] * world_size
        for p, owner in zip(self.params, assign_owners(self.costs, world_size)):
            held[owner] += per_param.get(id(p), 0)
        return held


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` on this rank (moments, step counts, statistics, roots, eigenbases);
    an optimizer made of others (Muon with AdamW) lists them as its ``parts``."""
    return sum(t.numel() * t.element_size() for part in getattr(optimizer, "parts", [optimizer])
               for state in part.state.values() for t in state.values() if isinstance(t, Tensor))


def mark_split(state: dict, split: OwnerSplit) -> dict:
    """Record over how many ranks the state was split (a checkpoint written by rank 0 holds its share only)."""
    state["split_world_size"] = split.world_size
    return state


def refuse_partial(state: dict, name: str) -> None:
    """A checkpoint of a split optimizer holds rank 0's share of the state: refuse it, on every rank alike."""
    world = state.get("split_world_size", 1)
    if world > 1:
        raise CheckpointError(f"this checkpoint's --optimizer {name} state was split over {world} ranks and holds "
                              "rank 0's share only; resuming it is not supported: start the run again without "
                              "--resume")


class SplitOptimizer(torch.optim.Optimizer):
    """A per-parameter optimizer whose parameters are split over the ranks: :meth:`step` runs ``_step_one(p, group)``
    on the parameters this rank owns, then :meth:`OwnerSplit.share`. Subclasses set :attr:`name`, call
    :meth:`_split` at the end of ``__init__`` with each parameter's cost, and write ``_step_one``.

    Attributes:
        split: the :class:`OwnerSplit` (owners, bytes sent).
    """

    name = ""

    def _split(self, costs: Sequence[float], distributed: bool | None) -> None:
        self.split = OwnerSplit([p for g in self.param_groups for p in g["params"]], costs, self.name, distributed)

    def _step_one(self, p: Tensor, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and self.split.mine(index):
                    self._step_one(p, group)
                index += 1
        self.split.share()
        return loss

    def state_dict(self) -> dict:
        return mark_split(super().state_dict(), self.split)

    def load_state_dict(self, state_dict: dict) -> None:
        refuse_partial(state_dict, self.name)
        super().load_state_dict(state_dict)

r"""Split a whole-matrix optimizer over the data-parallel ranks: each rank owns some parameters, steps only those,
and the stepped parameters travel from their owners to every rank.

Under data parallelism every rank holds the same averaged gradient, so every rank could run the optimizer on
every parameter, and Shampoo's, SOAP's or Muon's per-matrix work (eigendecompositions, Newton–Schulz) and
state would be repeated W times. Instead the W ranks form W/G *groups* of G consecutive ranks (distributed
Shampoo's ``num_trainers_per_group``); within its group parameter i gets one *owner* o_i
(:func:`labkit.optim.kfac.distributed.assign_owners` over the G ranks: largest cost first, each to the
least-loaded rank, the rule K-FAC uses for its decompositions), and per step, in the order
:meth:`OwnerSplit.share` codes it::

    on rank o_i of each group   state_i, W_i ← optimizer(state_i, W_i, ∇W_i)    work and state: 1/G of the total
    every rank                  W_i ← broadcast(W_i, src=o_i) within its group, one broadcast per owner rank,
                                its parameters packed

Every group steps every parameter, so each parameter's state is held by W/G ranks, one per group. The kit names
that number as K-FAC's KAISA does its grad workers (:mod:`labkit.optim.kfac.kaisa`): the *worker fraction*
``f = (W/G)/W = 1/G``, the fraction of the ranks that hold each parameter's state (``f·W`` must divide W).
``f = 1/W`` (G = W, the default): one owner per parameter in the whole job, the least state per rank (ZeRO-1's
pattern, the optimizer state sharded and the parameters gathered after the step: Moonlight's distributed Muon).
``f = 1`` (G = 1): every rank steps every parameter, as the single-process optimizer does, and nothing travels.
In between, state and work per rank fall as 1/G while the broadcasts stay inside groups of G ranks (consecutive
ranks: on a cluster, the ranks of one node first). Per step and rank, with ``s`` bytes per number and parameters
of ``n_i`` numbers (payload bytes of the broadcasts)::

    communication         s Σ_i n_i  if G > 1, else 0     every parameter leaves its owner once, in each group
    optimizer state       Σ_{i: o_i = r} state bytes_i    on rank r (see :func:`state_bytes`)
    copies of the state   W/G = f·W                       over the job

For Shampoo this is distributed Shampoo's split with the search direction replaced by the stepped parameter (the
same bytes). The groups are ``torch.distributed`` groups, made with ``new_group`` by every rank, for every group,
in the same order (a group of all W ranks too, so there is one code path whatever G).

A checkpoint holds the whole state: every rank calls :meth:`SplitOptimizer.gather_state_dict` when one is saved, the
owners' states travel to rank 0 (:meth:`OwnerSplit.gather_state`), and loading keeps each rank's share again
(:func:`re_split`), whatever the rank count and worker fraction of the resumed run.

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
from labkit.optim.kfac.kaisa import grad_workers


def group_size(world_size: int, fraction: float | None, flag: str) -> int:
    """G = 1/f ranks per group: f·W holders of each parameter's state, which must divide W (``None``: f = 1/W)."""
    if fraction is None:
        return world_size
    return world_size // grad_workers(world_size, fraction, flag)


def group_owners(costs: Sequence[float], world_size: int, g: int) -> list[list[int]]:
    """Per group of ``g`` consecutive ranks, the owner (a global rank) of each parameter."""
    local = assign_owners(costs, g)
    return [[start + o for o in local] for start in range(0, world_size, g)]


class OwnerSplit:
    """Who steps which parameter, and the broadcasts that share the stepped parameters.

    Args:
        params: every parameter the optimizer steps, in one fixed order (the same on every rank).
        costs: the work per parameter that :func:`assign_owners` balances.
        name: the optimizer's name, for the error messages (its flag is ``--{name}-worker-fraction``).
        distributed: split over the default process group; ``None``: when one with several ranks is running.
        fraction: f, the fraction of the ranks that hold each parameter's state (module docstring); ``None``: 1/W.

    Attributes:
        world_size, rank: the split's (1 and 0 on one process).
        group_size: G, the ranks of this rank's group.
        owners: owner rank (global) of each parameter in this rank's group.
        bytes_sent: payload bytes of the broadcasts so far.
    """

    def __init__(self, params: Sequence[Tensor], costs: Sequence[float], name: str, distributed: bool | None = None,
                 fraction: float | None = None):
        running = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        distributed = running if distributed is None else distributed and running
        self.params, self.costs, self.name = list(params), list(costs), name
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.fraction = fraction
        self.group_size = group_size(self.world_size, fraction, f"--{name}-worker-fraction")
        self.owners = group_owners(self.costs, self.world_size, self.group_size)[self.rank // self.group_size]
        self.bytes_sent = 0
        self.group = None
        if self.world_size > 1:
            # shapes and sums: equal shapes with other values are tensor-parallel shards, as wrong to share
            mine = [(tuple(p.shape), float(p.detach().double().sum())) for p in self.params]
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
            if any(s != mine for s in gathered):
                raise ConfigError(f"--optimizer {name} splits its work over the data-parallel ranks and needs the "
                                  "whole model on every rank (--strategy single or ddp), but the ranks hold different "
                                  "parameters")
        if self.group_size > 1:  # every rank makes every group, in the same order (new_group is collective)
            for start in range(0, self.world_size, self.group_size):
                group = dist.new_group(list(range(start, start + self.group_size)))
                if start <= self.rank < start + self.group_size:
                    self.group = group

    def mine(self, index: int) -> bool:
        """Does this rank step parameter ``index``?"""
        return self.owners[index] == self.rank

    def share(self) -> int:
        """Every parameter from its owner to every rank of its group (in place); returns and counts the payload
        bytes."""
        if self.group_size == 1:
            return 0
        with torch.no_grad():
            sent = broadcast_from_owners([[p.data] for p in self.params], self.owners, self.group)
        self.bytes_sent += sent
        return sent

    def gather_state(self, states: dict[int, dict]) -> dict[int, dict]:
        """The whole state, by parameter index, on rank 0: every rank calls this (one ``gather_object`` when G > 1;
        rank 0's group holds one copy of every parameter's state, so the other groups send nothing). Tensors travel
        and arrive on the CPU, as a checkpoint holds them. Other ranks get their own ``states`` back."""
        if self.group_size == 1:
            return states
        mine = ({i: {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in s.items()}
                 for i, s in states.items()} if self.rank < self.group_size else None)
        parts = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if self.rank != 0:
            return states
        return dict(sorted((i, s) for part in parts if part for i, s in part.items()))

    def communication_per_step(self, world_size: int | None = None, fraction: float | None = None) -> int:
        """Payload bytes of :meth:`share` per rank on ``world_size`` ranks with worker fraction ``fraction`` (default:
        this split's), from the shapes: ``s Σ_i n_i`` if G > 1, else 0."""
        world, fraction = (self.world_size, self.fraction) if world_size is None else (world_size, fraction)
        if group_size(world, fraction, f"--{self.name}-worker-fraction") == 1:
            return 0
        return sum(p.numel() * p.element_size() for p in self.params)

    def state_bytes_per_rank(self, optimizer: torch.optim.Optimizer, world_size: int,
                             fraction: float | None = None) -> list[int]:
        """The optimizer-state bytes each of ``world_size`` ranks would hold with worker fraction ``fraction``: the
        state of the parameters it would own in its group (this process's state, every parameter's, divided by the
        owners :func:`group_owners` gives)."""
        per_param = {}
        for part in getattr(optimizer, "parts", [optimizer]):
            for p, state in part.state.items():
                per_param[id(p)] = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))
        held = [0] * world_size
        g = group_size(world_size, fraction, f"--{self.name}-worker-fraction")
        for owners in group_owners(self.costs, world_size, g):
            for p, owner in zip(self.params, owners):
                held[owner] += per_param.get(id(p), 0)
        return held


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` on this rank (moments, step counts, statistics, roots, eigenbases);
    an optimizer made of others (Muon with AdamW) lists them as its ``parts``."""
    return sum(t.numel() * t.element_size() for part in getattr(optimizer, "parts", [optimizer])
               for state in part.state.values() for t in state.values() if isinstance(t, Tensor))


def mark_split(state: dict, split: OwnerSplit, gathered: bool = False) -> dict:
    """Record over how many ranks ``state`` is split: G for one rank's share, 1 for the whole state (one process, G = 1,
    or rank 0's after :meth:`OwnerSplit.gather_state`)."""
    state["split_world_size"] = 1 if gathered and split.rank == 0 else split.group_size
    return state


def refuse_partial(state: dict, name: str) -> None:
    """A state that holds one rank's share only (``optimizer.state_dict()`` on one rank of a split run, not the
    gathered one a checkpoint saves): refuse it, on every rank alike."""
    world = state.get("split_world_size", 1)
    if world > 1:
        raise CheckpointError(f"this checkpoint's --optimizer {name} state was split over {world} ranks and holds "
                              "one rank's share only; resuming it is not supported: start the run again without "
                              "--resume")


def re_split(optimizer: torch.optim.Optimizer, split: OwnerSplit) -> None:
    """Keep the state of the parameters this rank owns and drop the rest (after loading the whole state)."""
    for index, p in enumerate(split.params):
        if not split.mine(index):
            optimizer.state.pop(p, None)


class SplitOptimizer(torch.optim.Optimizer):
    """A per-parameter optimizer whose parameters are split over the ranks: :meth:`step` runs ``_step_one(p, group)``
    on the parameters this rank owns, then :meth:`OwnerSplit.share`. Subclasses set :attr:`name`, call
    :meth:`_split` at the end of ``__init__`` with each parameter's cost, and write ``_step_one``.

    Attributes:
        split: the :class:`OwnerSplit` (owners, bytes sent).
    """

    name = ""

    def _split(self, costs: Sequence[float], distributed: bool | None, fraction: float | None = None) -> None:
        self.split = OwnerSplit([p for g in self.param_groups for p in g["params"]], costs, self.name, distributed,
                                fraction)

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
        """This rank's share of the state (marked as such: see :meth:`gather_state_dict` for a checkpoint's)."""
        return mark_split(super().state_dict(), self.split)

    def gather_state_dict(self) -> dict:
        """The whole state on rank 0, every owner's gathered (:meth:`OwnerSplit.gather_state`): every rank calls it
        when a checkpoint is saved (:func:`labkit.train.checkpoint.save_training_state`)."""
        state = super().state_dict()
        state["state"] = self.split.gather_state(state["state"])
        return mark_split(state, self.split, gathered=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (one process's or a gathered one), then keep this rank's share: any rank count and
        worker fraction resumes it."""
        refuse_partial(state_dict, self.name)
        super().load_state_dict(state_dict)
        re_split(self, self.split)

"""Prices of the sharded data-parallel strategies: ZeRO stages 1-3 and FSDP2 (notation: :mod:`labkit.advisor.cost`).

Each module owning parameters is one unit of ``U`` bytes, sharded over ``p`` ranks. Ring collectives over a
unit: ``RS(U) = (p − 1)·(α + (β + γ)·U/p)`` (reduce-scatter, every chunk added once), ``AG(U) =
(p − 1)·(α + β·U/p)`` (all-gather), paid per unit: a model of many small layers pays α many times.
Every rank trains ``b = B/p`` samples and steps only its shard (``update = u·P/p``).
"""
from __future__ import annotations

from labkit.advisor.cost import broadcast_time, common_terms, compute_scale, memory_terms
from labkit.advisor.plan import Estimate, Plan
from labkit.advisor.profile import Profile
from labkit.advisor.topology import Topology


def reduce_scatter_time(nbytes: float, ranks: int, topo: Topology) -> float:
    """``RS(U) = (p − 1)·(α + (β + γ)·U/p)``."""
    link = topo.collective_link(ranks)
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * (link.alpha + (link.beta + link.gamma) * nbytes / ranks)


def all_gather_time(nbytes: float, ranks: int, topo: Topology) -> float:
    """``AG(U) = (p − 1)·(α + β·U/p)``."""
    link = topo.collective_link(ranks)
    return (ranks - 1) * (link.alpha + link.beta * nbytes / ranks) if ranks > 1 else 0.0


def _units(prof: Profile) -> list[float]:
    return [layer.param_bytes / layer.units for layer in prof.layers if layer.param_bytes for _ in range(layer.units)]


def stage_of(plan: Plan) -> int:
    """ZeRO's stage, or FSDP's equivalent: 3 (reshard after forward) or 2 (``--fsdp-no-reshard``)."""
    if plan.strategy == "fsdp":
        return 2 if plan.option.get("fsdp_no_reshard") else 3
    return plan.option.get("zero_stage", 1)


def collective_count(stage: int, units: int) -> int:
    """``N_s``, the reduce-scatters and all-gathers one step launches: per unit a reduce-scatter and ``g``
    all-gathers (``g = 2`` at stage 3 / FSDP with resharding, else 1); ZeRO's buffer broadcasts apart."""
    return units * (1 + (2 if stage == 3 else 1))


def bytes_time(units: list[float], ranks: int, stage: int, topo: Topology) -> float:
    """The bytes part of a step's reduce-scatters and all-gathers: ``Σ_units (p − 1)/p·U·((β + γ) + g·β)``."""
    if ranks <= 1:
        return 0.0
    link = topo.collective_link(ranks)
    g = 2 if stage == 3 else 1
    return (ranks - 1) / ranks * sum(units) * (link.beta + link.gamma + g * link.beta)


def price_sharded(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """ZeRO (``--zero-stage 1|2|3``) and FSDP (reshard after forward, or ``--fsdp-no-reshard``), ``b = B/p``:

    ``compute = s·T_all(b)``; ``communication = Σ_units RS(U) + g·AG(U)`` with ``g = 1`` (ZeRO 1, 2: gather
    the stepped parameters; FSDP no-reshard: gather once before forward) or ``g = 2`` (ZeRO 3, FSDP: gather
    before forward and again before backward), each collective paying its ``(p − 1)·α`` per unit, ``+
    BC(N_buf, n_buf)`` for ZeRO, which broadcasts each of the model's ``N_buf`` buffers from rank 0 before every
    forward (:func:`labkit.advisor.cost.broadcast_time`; FSDP leaves buffers alone).
    Memory (fp32, momentum: optimizer state = P):
    stage 1 ``2P + P/p``; stage 2 ``P + 2P/p``; stage 3 / FSDP ``3P/p + 2·max U`` (a gathered unit and its
    prefetched neighbour); FSDP no-reshard ``P + 2P/p`` (gathered parameters live from forward to backward);
    plus activations ``M_all(b)``.
    """
    p, b, P = plan.processes, plan.batch_size / plan.processes, prof.param_bytes
    stage = stage_of(plan)
    units = _units(prof)
    gathers = 2 if stage == 3 else 1
    comm = sum(reduce_scatter_time(u, p, topo) + gathers * all_gather_time(u, p, topo) for u in units)
    if plan.strategy == "zero":
        comm += broadcast_time(*prof.buffers, p, topo)
    time = {"compute": compute_scale(topo, p) * prof.time(b), "communication": comm,
            **common_terms(prof, topo, P / p, b)}
    memory = memory_terms(prof, topo, P, prof.saved_bytes(b))
    if stage == 1:
        memory["optimizer"] = P / p
    elif stage == 2:
        memory["gradients"] = memory["optimizer"] = P / p
    else:
        memory.update(parameters=P / p, gradients=P / p, optimizer=P / p, buffers=2 * max(units, default=0.0))
    return Estimate(plan, time, memory)

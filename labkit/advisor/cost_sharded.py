"""Prices of the sharded data-parallel strategies: ZeRO stages 1-3 and FSDP2 (notation: :mod:`labkit.advisor.cost`).

Each module owning parameters is one unit of ``U`` bytes, sharded over ``p`` ranks. Ring collectives over a
unit: ``RS(U) = (p − 1)·(α + (β + γ)·U/p) + κ`` (reduce-scatter, every chunk added once), ``AG(U) =
(p − 1)·(α + β·U/p) + κ`` (all-gather); κ is what each collective launched between computations costs on top
(:class:`labkit.advisor.topology.Topology`), paid per unit: a model of many small layers pays it many times.
Every rank trains ``b = B/p`` samples and steps only its shard (``update = u·P/p``).

Where the topology holds a measured price per collective for the strategy, ``c_s`` (``Topology.call_s``,
:mod:`labkit.advisor.calibrate`: the strategy itself run on a calibration chain), a step's ``N_s`` collectives
cost ``N_s·c_s`` plus their bytes at ``β`` (and ``γ`` for the reduction) instead of ``(p − 1)·α + κ`` each: on
a CPU the fixed part of each collective is the strategy's Python hooks, copies and the wake-up of the waiting
gloo worker, which the α-β fit of a tight loop of messages does not see (measured: 0.6–2.5 ms per collective
in a training step on 2 gloo ranks, against α ≈ 0.2 ms).
"""
from __future__ import annotations

from labkit.advisor.cost import broadcast_time, common_terms, compute_scale, memory_terms
from labkit.advisor.plan import Estimate, Plan
from labkit.advisor.profile import Profile
from labkit.advisor.topology import Topology


def reduce_scatter_time(nbytes: float, ranks: int, topo: Topology) -> float:
    """``RS(U) = (p − 1)·(α + (β + γ)·U/p) + κ``."""
    link = topo.collective_link(ranks)
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * (link.alpha + (link.beta + link.gamma) * nbytes / ranks) + topo.launch_s


def all_gather_time(nbytes: float, ranks: int, topo: Topology) -> float:
    """``AG(U) = (p − 1)·(α + β·U/p) + κ``."""
    link = topo.collective_link(ranks)
    return (ranks - 1) * (link.alpha + link.beta * nbytes / ranks) + topo.launch_s if ranks > 1 else 0.0


def _units(prof: Profile) -> list[float]:
    return [layer.param_bytes / layer.units for layer in prof.layers if layer.param_bytes for _ in range(layer.units)]


def stage_of(plan: Plan) -> int:
    """ZeRO's stage, or FSDP's equivalent: 3 (reshard after forward) or 2 (``--fsdp-no-reshard``)."""
    if plan.strategy == "fsdp":
        return 2 if plan.option.get("fsdp_no_reshard") else 3
    return plan.option.get("zero_stage", 1)


def call_key(strategy: str, stage: int) -> str:
    """The name a measured per-collective price is kept under: ``zero-1`` … ``zero-3``, ``fsdp``, ``fsdp-no-reshard``."""
    return f"zero-{stage}" if strategy == "zero" else ("fsdp" if stage == 3 else "fsdp-no-reshard")


def collective_count(stage: int, units: int) -> int:
    """``N_s``, the reduce-scatters and all-gathers one step launches: per unit a reduce-scatter and ``g``
    all-gathers (``g = 2`` at stage 3 / FSDP with resharding, else 1). ZeRO's buffer broadcasts are counted
    apart (:data:`BROADCAST_KEY`)."""
    return units * (1 + (2 if stage == 3 else 1))


#: the measured price of one of ZeRO's buffer broadcasts (tiny tensors, back to back before each forward)
BROADCAST_KEY = "zero-broadcast"


def buffer_broadcasts(prof_buffers: tuple[int, int], ranks: int, topo: Topology) -> float:
    """ZeRO's ``N_buf`` buffer broadcasts: ``N_buf·c_b + (p − 1)·β·n_buf`` with the measured ``c_b``
    (``Topology.call_s[BROADCAST_KEY]``), else ``BC(N_buf, n_buf)`` (:func:`labkit.advisor.cost.broadcast_time`)."""
    count, nbytes = prof_buffers
    if ranks <= 1 or count == 0:
        return 0.0
    price = topo.call_s.get(BROADCAST_KEY)
    if price is None:
        return broadcast_time(count, nbytes, ranks, topo)
    return count * price + (ranks - 1) * topo.collective_link(ranks).beta * nbytes


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
    before forward and again before backward), each collective paying its ``(p − 1)·α + κ`` per unit, ``+
    BC(N_buf, n_buf)`` for ZeRO, which broadcasts each of the model's ``N_buf`` buffers from rank 0 before every
    forward (:func:`labkit.advisor.cost.broadcast_time`; FSDP leaves buffers alone). With a measured price per
    collective ``c_s``: ``communication = N_s·c_s + bytes`` (:func:`collective_count`, :func:`bytes_time`), and
    ZeRO's broadcasts at their own measured price (:func:`buffer_broadcasts`).
    Memory (fp32, momentum: optimizer state = P):
    stage 1 ``2P + P/p``; stage 2 ``P + 2P/p``; stage 3 / FSDP ``3P/p + 2·max U`` (a gathered unit and its
    prefetched neighbour); FSDP no-reshard ``P + 2P/p`` (gathered parameters live from forward to backward);
    plus activations ``M_all(b)``.
    """
    p, b, P = plan.processes, plan.batch_size / plan.processes, prof.param_bytes
    stage = stage_of(plan)
    units = _units(prof)
    gathers = 2 if stage == 3 else 1
    call = topo.call_s.get(call_key(plan.strategy, stage)) if p > 1 else None
    if call is not None:
        comm = collective_count(stage, len(units)) * call + bytes_time(units, p, stage, topo)
    else:
        comm = sum(reduce_scatter_time(u, p, topo) + gathers * all_gather_time(u, p, topo) for u in units)
    if plan.strategy == "zero":
        comm += buffer_broadcasts(prof.buffers, p, topo)
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

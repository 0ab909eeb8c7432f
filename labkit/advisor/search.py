"""The search over both plan spaces, each plan priced by a pure function and ranked by predicted step (those that
do not fit in memory last): every device mesh (:func:`mesh_candidates`, by :func:`labkit.parallel.pricing.price_mesh`)
and every strategy with its parameters (:func:`candidates`) whose module declares an ``ADVISOR`` literal beside its
``FLAGS``: its ``"price"`` function ``(plan, profile, topology) -> Estimate``, its ``"plans"`` enumerator in
:data:`PLANS`, its ``"batch"``: how a plan splits the global batch (:attr:`labkit.advisor.plan.Plan.data_parallel`)."""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from labkit.advisor.plan import Estimate, MeshPlan, Plan, Profile
from labkit.advisor.topology import GB, MB, Topology
from labkit.errors import ConfigError
from labkit.flags import resolve
from labkit.parallel.pricing import price_mesh
from labkit.strategies import STRATEGIES, registered, strategy_literal

EXHAUSTIVE_SPLITS = 2000
MICROBATCHES = (1, 2, 4, 8, 16, 32)
#: the function ``"module:function"`` names


def price(plan: Plan, prof: Profile, topo: Topology, serial: Profile | None = None) -> Estimate:
    """``plan`` priced by its strategy's ``ADVISOR`` function with ``prof``, the profile at its threads per process.
    On a CPU, with ``serial`` (the profile at one thread), work is conserved both ways: one process costs the cheaper
    of its ``c``-thread and one-thread profiles (a slower ``c``-thread profile is the machine's load, not the plan);
    ``q > 1`` processes on ``c`` cores take at least ``(T(B) + u·P + d·B) / min(q, c)`` of ``serial`` (compute makes
    up the difference): ``q`` ranks are never priced more than ``c`` times faster than one."""
    entry = strategy_literal(plan.strategy, "ADVISOR") if plan.strategy in STRATEGIES else None
    if entry is None or "price" not in entry:
        raise ConfigError(f"strategy {plan.strategy!r} has no ADVISOR literal with a 'price' function; the advisor "
                          f"prices: {', '.join(registered('ADVISOR'))}")
    est = resolve(entry["price"])(plan, prof, topo)
    est.limit_bytes, est.threads = topo.memory_bytes, prof.threads if topo.device == "cpu" else 0
    if serial is None or topo.device != "cpu" or not est.applicable:
        return est
    if plan.processes == 1:
        return min(est, price(plan, serial, topo), key=lambda e: (not e.applicable, e.step_s))
    b = plan.batch_size
    work = serial.time(b) + serial.update_s_per_byte * serial.param_bytes + serial.data_s_per_sample * b
    if (short := work / min(plan.processes, topo.cores) - est.step_s) > 0:
        est.time["compute"] = est.time.get("compute", 0.0) + short
    return est


def best_balance(make: Callable[[tuple[int, ...]], Estimate], prof: Profile, stages: int, micro: float) -> Estimate:
    """The cheapest plan over the balances (layers per stage) of ``stages`` stages: **exhaustively** over the
    ``C(L − 1, p − 1)`` contiguous splits up to :data:`EXHAUSTIVE_SPLITS`; beyond, by the min-max programme on stage
    times (:func:`labkit.strategies.stage_balance.partition`), which ignores the cut's message size."""
    from labkit.strategies.stage_balance import balance_from_split_points, partition  # torchgpipe: CNN pipelines only

    n = len(prof.layers)
    if math.comb(n - 1, stages - 1) > EXHAUSTIVE_SPLITS:
        return make(tuple(partition([layer.time(micro) for layer in prof.layers], stages)))
    cuts = itertools.combinations(range(1, n), stages - 1)
    return min((make(tuple(balance_from_split_points(n, c))) for c in cuts), key=_rank_key)


def _rank_key(est: Estimate) -> tuple:
    return (not est.applicable, not est.feasible, est.step_s if est.applicable else math.inf)


@dataclass(frozen=True)
class Space:
    """What an enumerator searches: the global ``batch`` on ``topo``; ``add(plan)`` prices a plan (:func:`price`)."""

    batch: int
    topo: Topology
    prof_for: Callable[[int], Profile]

    def add(self, plan: Plan) -> Estimate:  # serial: the profile of ``cores`` processes, one thread each
        return price(plan, self.prof_for(plan.processes), self.topo, self.prof_for(self.topo.cores))


def spread_plans(name: str, entry: dict, space: Space) -> Iterator[Estimate]:
    """``"plans": "spread"``: ``p = 2..N`` ranks dividing the batch, each combination of ``"grid"`` (``{option:
    [values]}``), or only the cheapest with ``"keep": "cheapest"`` (on a tie the first: ``ddp``'s PyTorch DDP)."""
    grid = entry.get("grid", {})
    for p in range(2, space.topo.ranks + 1):
        if space.batch % p == 0:
            found = [space.add(Plan(name, p, p, space.batch, tuple(zip(grid, values)),
                                    p if entry.get("batch") == "split" else 1))
                     for values in itertools.product(*grid.values())]
            yield from [min(found, key=lambda e: e.step_s)] if entry.get("keep") == "cheapest" else found


def server_plans(name: str, entry: dict, space: Space) -> list[Estimate]:
    """``"plans": "servers"``: ``p = 2..N`` ranks, ``S = 1..p − 1`` servers, the ``p − S`` workers dividing the
    batch."""
    return [space.add(Plan(name, p, p, space.batch, ((entry["servers"], s),), p - s))
            for p in range(2, space.topo.ranks + 1) for s in range(1, p) if space.batch % (p - s) == 0]


def pipeline_plans(name: str, entry: dict, space: Space) -> Iterator[Estimate]:
    """``"plans": "pipeline"``: ``p = 2..N`` stages (at most one per layer; one process for all with
    ``"processes": "one"``), each ``m`` of :data:`MICROBATCHES` dividing the batch (only ``m = 1`` without a
    ``"microbatches"`` role), the best balance of each (:func:`best_balance`), 1f1b where gpipe's does not fit;
    ``"options"`` maps roles ``microbatches``, ``stages``, ``balance``, ``split_points``, ``schedule`` to options."""
    roles, batch, most = entry["options"], space.batch, min(space.topo.ranks, len(space.prof_for(1).layers))
    micro = [m for m in MICROBATCHES if batch % m == 0 and (m == 1) == ("microbatches" not in roles)]
    for p, m in itertools.product(range(2, most + 1), micro):
        procs = 1 if entry.get("processes") == "one" else p

        def make(balance, schedule="gpipe"):
            values = {"microbatches": m, "stages": p, "balance": balance, "schedule": schedule,
                      "split_points": tuple(itertools.accumulate(balance[:-1]))}
            opts = tuple((dest, values[role]) for role, dest in roles.items() if values[role] != "gpipe")
            return space.add(Plan(name, procs, p, batch, opts))

        est = best_balance(make, space.prof_for(procs), p, batch / m)
        if "schedule" in roles and not est.feasible and m >= p:
            est = min(est, best_balance(lambda b: make(b, "1f1b"), space.prof_for(procs), p, batch / m), key=_rank_key)
        yield est


#: the enumerators an ``ADVISOR`` literal's ``"plans"`` names; ``"one"``: the strategy on one process
PLANS = {"one": lambda name, entry, space: [space.add(Plan(name, 1, 1, space.batch))], "spread": spread_plans,
         "servers": server_plans, "pipeline": pipeline_plans}


def candidates(prof_for: Callable[[int], Profile], topo: Topology, batch: int,
               strategies: tuple[str, ...] | None = None) -> list[Estimate]:
    """Every plan priced, best first. ``prof_for(processes)`` gives the profile at that many processes' threads."""
    entries = registered("ADVISOR")  # {strategy: its ADVISOR literal}, in registry order
    space, out = Space(batch, topo, prof_for), []
    for name in (s for s in (strategies or entries) if s in entries):
        kind = entries[name].get("plans", "one")
        if kind not in PLANS:
            raise ConfigError(f"strategy {name!r}: ADVISOR's 'plans' is {kind!r}; use one of {', '.join(PLANS)}")
        out += PLANS[kind](name, entries[name], space)
    if not out:
        raise ConfigError("no strategy to search: give at least one of " + ", ".join(entries))
    return sorted(out, key=_rank_key)


def best_per_strategy(estimates: list[Estimate], key=lambda e: e.plan.strategy) -> list[Estimate]:
    """The first (best) estimate of each strategy (or of each ``key``), in rank order."""
    first: dict = {}
    for est in estimates:
        first.setdefault(key(est), est)
    return list(first.values())


def check_fits(estimates: list[Estimate], limit_gb: float | None) -> None:
    """Raise :class:`ConfigError` naming the smallest memory that would fit when no plan fits ``limit_gb``."""
    runnable = [e for e in estimates if e.applicable]
    if runnable and not any(e.feasible for e in runnable):
        smallest = min(runnable, key=lambda e: e.peak_bytes)
        raise ConfigError(f"no plan fits in {limit_gb:g} GB per device; the smallest needs "
                          f"{smallest.peak_bytes / GB:.3f} GB ({smallest.plan.label}): raise --memory-limit")


def _valid(p: MeshPlan, model, batch: int) -> bool:
    """What the dimensions accept: a CNN dp and pp (at most one stage per layer); a GPT's tp divides the heads, pp the
    blocks, 2·cp the sequence (zig-zag), cp and pp not together, ep the experts (a MoE takes only dp and ep), SP only
    with tp; ``dp·ep·m`` divides the batch, ``m ≥ pp`` with a pipeline (else 1), ZeRO over ``dp·cp·ep > 1`` replicas."""
    if isinstance(model, Profile):
        shape = p.tp == p.cp == p.ep == 1 and not p.sequence_parallel and not p.recompute and p.pp <= len(model.layers)
    else:
        shape = ((p.tp == p.pp == p.cp == 1 and model.n_expert % p.ep == 0 if model.n_expert else p.ep == 1)
                 and model.n_head % p.tp == 0 and model.n_layer % p.pp == 0 and model.seq % (2 * p.cp) == 0
                 and not (p.cp > 1 and p.pp > 1) and (not p.sequence_parallel or p.tp > 1))
    return (shape and batch % (p.dp * p.ep * p.microbatches) == 0 and (p.zero == 0 or p.dp * p.cp * p.ep > 1)
            and (p.microbatches >= p.pp if p.pp > 1 else p.microbatches == 1))


def meshes(devices: int, model, batch: int) -> list[MeshPlan]:
    """Every valid plan using all ``devices``: ``dp·tp·pp·cp·ep = N`` over its divisors."""
    divisors = [k for k in range(1, devices + 1) if devices % k == 0]
    plans = (MeshPlan(devices // (tp * pp * cp * ep), tp, pp, cp, m, zero, sp, rc, ep)
             for tp, pp, cp, ep in itertools.product(divisors, repeat=4) if devices % (tp * pp * cp * ep) == 0
             for m, zero, sp, rc in itertools.product(MICROBATCHES, range(4), (False, True), (False, True)))
    return [plan for plan in plans if _valid(plan, model, batch)]


def mesh_candidates(model, topo: Topology, batch: int, devices: int | None = None) -> list[Estimate]:
    """Every plan of :func:`meshes` priced (``model``: a GPT's ``GPTShape`` or a CNN's profile), best first."""
    found = (price_mesh(p, model, topo, batch) for p in meshes(devices or topo.ranks, model, batch))
    return sorted(found, key=lambda e: (not e.feasible, e.step_s, e.peak_bytes, e.plan.label))


def frontier(estimates: list[Estimate]) -> list[Estimate]:
    """The feasible plans no other beats on both step time and memory (fastest first)."""
    ranked = sorted((e for e in estimates if e.feasible), key=lambda e: (e.step_s, e.peak_bytes))
    least = itertools.accumulate((e.peak_bytes for e in ranked), min, initial=math.inf)  # of the plans before each
    return [e for e, before in zip(ranked, least) if e.peak_bytes < before]


def size(nbytes: float) -> str:
    return f"{nbytes / GB:.0f} GB" if nbytes >= GB else f"{nbytes / MB:.1f} MB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2g} ms"


def explain(estimates: list[Estimate], model, topo: Topology) -> str:
    """Why the best plan wins, in words: the faster plan that does not fit (if one is faster), then against
    the best plan of each of the next mesh shapes, the term that decides, or the memory that rules it out."""
    what = (f"{model.model} on {model.dataset}" if isinstance(model, Profile)
            else f"a {model.name} GPT at sequence {model.seq}")
    best, limit, fastest = estimates[0], size(topo.memory_bytes), min(estimates, key=lambda e: e.step_s)
    if not best.feasible:
        return f"on {topo.name}, no plan for {what} fits in memory"
    reasons = [] if fastest.feasible else [f"the faster {fastest.plan.label} ({ms(fastest.step_s)}) needs "
                                           f"{size(fastest.peak_bytes)} per device (> {limit})"]
    shapes = best_per_strategy(estimates, lambda e: (e.plan.dp, e.plan.tp, e.plan.pp, e.plan.cp, e.plan.ep))
    for e in shapes[1:4 - len(reasons)]:  # three reasons at most
        if not e.feasible:
            reasons.append(f"{e.plan.label} needs {size(e.peak_bytes)} per device (> {limit})")
        else:
            term = max(e.time, key=lambda k: e.time[k] - best.time.get(k, 0.0))
            reasons.append(f"{e.plan.label} is {(e.step_s / best.step_s - 1):.0%} slower ({term} "
                           f"{ms(e.time[term])} against {ms(best.time.get(term, 0.0))})")
    return (f"on {topo.name}, {what}: {best.plan.label} ({ms(best.step_s)}/step, {size(best.peak_bytes)} per "
            "device) because " + ("; ".join(reasons) or "it is the only mesh"))

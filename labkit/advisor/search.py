"""The strategy search: every strategy with its parameters, each plan priced, ranked by predicted step time.

A strategy is searched when its module declares an ``ADVISOR`` literal beside its ``FLAGS``, read without
importing the module (:func:`labkit.strategies.registered`)::

    ADVISOR = {"price": "labkit.strategies.ddp:price_ddp", "plans": "spread", "batch": "split",
               "grid": {"allreduce": ["ddp", "ring"]}, "keep": "cheapest"}

``price`` names its pricing function, ``(plan, profile, topology) -> Estimate``, pure, its formula in its
docstring (:func:`price` adds what every plan pays); ``batch`` how a plan splits the global batch
(:attr:`labkit.advisor.plan.Plan.data_parallel`); ``plans`` which plans to enumerate for ``N`` ranks and global
batch ``B``:

* ``"one"``: one plan on one process (``single``);
* ``"spread"``: ``p = 2..N`` ranks with ``p`` dividing ``B``, one plan per combination of its ``"grid"``
  (``{option: [values]}``, e.g. ``zero``'s stages 1, 2, 3, ``fsdp`` resharding or not), or only the cheapest of
  them with ``"keep": "cheapest"`` (``ddp``'s all-reduces, PyTorch's ``ddp`` first and so kept on ties: it is the
  library's); ``hybrid`` and ``tensor-parallel`` have no grid;
* ``"servers"``: ``p = 2..N`` ranks of which ``S = 1..p − 1`` are servers (the option its ``"servers"`` names)
  and ``W = p − S`` workers dividing ``B`` (``ps``, synchronous);
* ``"pipeline"``: ``p = 2..N`` stages (one process each, or one process for all with ``"processes": "one"``),
  with ``m ∈ {1, 2, 4, …, 32}`` micro-batches dividing ``B`` — ``m > 1`` where its ``"options"`` name a
  ``"microbatches"`` option, else ``m = 1`` (``model-parallel``) — the gpipe schedule (and 1f1b where gpipe's
  does not fit in memory, where they name a ``"schedule"`` option); its ``"options"`` map the pipeline's
  quantities (``microbatches``, ``stages``, ``balance``, ``split_points``, ``schedule``) to the strategy's
  option names (``pipeline``, ``gpipe``, ``model-parallel``).

The split points (balance) of each pipeline: **exhaustive** over all ``C(L − 1, p − 1)`` contiguous
splits when there are at most :data:`EXHAUSTIVE_SPLITS`, each priced whole (compute, messages at the cut,
memory); beyond that a **heuristic**: the exact min-max dynamic programme over layer groups on stage
times ``T_{stage}(B/m)`` (:func:`labkit.strategies.model_parallel.partition`), which ignores the cut's
message size. Infeasible plans (too much memory per device) stay in the list, marked, below the feasible ones.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from labkit.advisor.alphabeta import cpu_floor
from labkit.advisor.plan import Estimate, Plan, Profile
from labkit.advisor.topology import Topology
from labkit.errors import ConfigError

EXHAUSTIVE_SPLITS = 2000
MICROBATCHES = (1, 2, 4, 8, 16, 32)


@functools.lru_cache(maxsize=None)
def load(target: str) -> Callable:
    """The function ``"module:function"`` names."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def pricer(strategy: str) -> Callable[[Plan, Profile, Topology], Estimate]:
    """The pricing function strategy ``strategy``'s ``ADVISOR`` literal names."""
    from labkit.strategies import STRATEGIES, registered, strategy_literal

    entry = strategy_literal(strategy, "ADVISOR") if strategy in STRATEGIES else None
    if entry is None or "price" not in entry:
        raise ConfigError(f"strategy {strategy!r} has no ADVISOR literal with a 'price' function; the advisor "
                          f"prices: {', '.join(registered('ADVISOR'))}")
    return load(entry["price"])


def serial_step(prof: Profile, batch: int) -> float:
    """One process's step on ``batch`` samples with ``prof``: compute, update and data."""
    return prof.time(batch) + prof.update_s_per_byte * prof.param_bytes + prof.data_s_per_sample * batch


def _price(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    est = pricer(plan.strategy)(plan, prof, topo)
    est.limit_bytes = topo.memory_bytes
    est.threads = prof.threads if topo.device == "cpu" else 0
    return est


def price(plan: Plan, prof: Profile, topo: Topology, serial: Profile | None = None) -> Estimate:
    """The estimate of ``plan`` with ``prof`` measured at the plan's threads per process (the profile's level is
    ``labkit train``'s own step, its bookkeeping included). The loop's stop check is not priced: it is one tiny
    non-blocking all-reduce every few tenths of a second (:class:`labkit.preempt.StopCheck`), nothing measurable
    per step.

    On a CPU, with ``serial`` (the profile at one thread per process), work is conserved both ways:

    * a plan of ``q > 1`` processes on ``c`` cores takes at least ``serial_step(B) / min(q, c)`` (the compute
      term makes up any difference): ``q`` ranks never do one thread's work more than ``c`` times faster;
    * a one-process plan is priced at the cheaper of its ``c``-thread and one-thread profiles: a process given
      more threads can do at least what it does on one (a profile at ``c`` threads taken while other programs
      hold the cores can be ten times slower than at one; that is the load, not the plan).

    So ``q`` ranks on ``c`` cores are never priced more than ``c`` times faster than one process."""
    est = _price(plan, prof, topo)
    if serial is None or topo.device != "cpu" or not est.applicable:
        return est
    if plan.processes == 1:
        alt = _price(plan, serial, topo) if serial is not prof else est
        return alt if alt.applicable and alt.step_s < est.step_s else est
    short = cpu_floor(serial_step(serial, plan.batch_size), plan.processes, topo.cores) - est.step_s
    if short > 0:
        est.time["compute"] = est.time.get("compute", 0.0) + short
    return est


def splits(layers: int, stages: int) -> Iterator[tuple[int, ...]]:
    """Every balance (layers per stage, each >= 1) of ``layers`` layers into ``stages`` contiguous stages."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def best_balance(make: Callable[[tuple[int, ...]], Estimate], prof: Profile, stages: int,
                 micro: float) -> Estimate:
    """The cheapest plan over the balances of ``stages`` stages (exhaustive or by the min-max heuristic)."""
    n = len(prof.layers)
    if math.comb(n - 1, stages - 1) <= EXHAUSTIVE_SPLITS:
        return min((make(b) for b in splits(n, stages)), key=_rank_key)
    from labkit.strategies.model_parallel import partition

    return make(tuple(partition([layer.time(micro) for layer in prof.layers], stages)))


def _rank_key(est: Estimate) -> tuple:
    return (not est.applicable, not est.feasible, est.step_s if est.applicable else math.inf)


@dataclass(frozen=True)
class Space:
    """What an enumerator searches: the global batch, the topology's ranks, the model's layers, the profile at a
    number of processes and the function that prices a plan (``add(plan) -> Estimate``)."""

    batch: int
    ranks: int
    layers: int
    prof_for: Callable[[int], Profile]
    add: Callable[[Plan], Estimate]


def one_plan(name: str, entry: dict, space: Space) -> list[Estimate]:
    """``"plans": "one"``: the strategy on one process."""
    return [space.add(Plan(name, 1, 1, space.batch))]


def spread_plans(name: str, entry: dict, space: Space) -> list[Estimate]:
    """``"plans": "spread"``: ``p = 2..N`` ranks dividing the batch, each combination of ``"grid"``."""
    grid = entry.get("grid", {})
    out = []
    for p in range(2, space.ranks + 1):
        if space.batch % p:
            continue
        found = [space.add(Plan(name, p, p, space.batch, tuple(zip(grid, values))))
                 for values in itertools.product(*grid.values())]
        out += [min(found, key=lambda e: e.step_s)] if entry.get("keep") == "cheapest" else found
    return out


def server_plans(name: str, entry: dict, space: Space) -> list[Estimate]:
    """``"plans": "servers"``: ``p = 2..N`` ranks, ``S = 1..p − 1`` servers, the workers dividing the batch."""
    return [space.add(Plan(name, p, p, space.batch, ((entry["servers"], s),)))
            for p in range(2, space.ranks + 1) for s in range(1, p) if space.batch % (p - s) == 0]


def pipeline_plans(name: str, entry: dict, space: Space) -> list[Estimate]:
    """``"plans": "pipeline"``: ``p = 2..N`` stages (at most one per layer), each micro-batch count, the best
    balance of each (:func:`best_balance`), 1f1b where gpipe's does not fit."""
    roles, batch, found = entry["options"], space.batch, []
    for p, m in itertools.product(range(2, min(space.ranks, space.layers) + 1), MICROBATCHES):
        if batch % m or m > batch or (m == 1) != ("microbatches" not in roles):
            continue
        procs = 1 if entry.get("processes") == "one" else p

        def make(balance, schedule="gpipe"):
            values = {"microbatches": m, "stages": p, "balance": balance, "schedule": schedule,
                      "split_points": tuple(itertools.accumulate(balance[:-1]))}
            opts = tuple((dest, values[role]) for role, dest in roles.items()
                         if role != "schedule" or schedule != "gpipe")
            return space.add(Plan(name, procs, p, batch, opts))

        est = best_balance(make, space.prof_for(procs), p, batch / m)
        if "schedule" in roles and not est.feasible and m >= p:
            est = min(est, best_balance(lambda b: make(b, "1f1b"), space.prof_for(procs), p, batch / m), key=_rank_key)
        found.append(est)
    return found


#: the enumerators an ``ADVISOR`` literal's ``"plans"`` names
PLANS = {"one": one_plan, "spread": spread_plans, "servers": server_plans, "pipeline": pipeline_plans}


def _enumerator(name: str, entry: dict) -> Callable[[str, dict, Space], list[Estimate]]:
    kind = entry.get("plans", "one")
    if kind not in PLANS:
        raise ConfigError(f"strategy {name!r}: ADVISOR's 'plans' is {kind!r}; use one of {', '.join(PLANS)}")
    return PLANS[kind]


def candidates(prof_for: Callable[[int], Profile], topo: Topology, batch: int,
               strategies: tuple[str, ...] | None = None) -> list[Estimate]:
    """Every plan priced, best first. ``prof_for(processes)`` gives the profile at that many processes' threads."""
    from labkit.strategies import registered

    entries = registered("ADVISOR")  # {strategy: its ADVISOR literal}, in registry order
    names = [s for s in (strategies or entries) if s in entries]

    def add(plan: Plan) -> Estimate:
        return price(plan, prof_for(plan.processes), topo, prof_for(topo.cores) if topo.device == "cpu" else None)

    space = Space(batch, topo.ranks, len(prof_for(1).layers), prof_for, add)
    out: list[Estimate] = []
    for name in names:
        out += _enumerator(name, entries[name])(name, entries[name], space)
    if not out:
        raise ConfigError("no strategy to search: give at least one of " + ", ".join(entries))
    return sorted(out, key=_rank_key)


def best_per_strategy(estimates: list[Estimate]) -> list[Estimate]:
    """The first (best) estimate of each strategy, in rank order."""
    seen, out = set(), []
    for est in estimates:
        if est.plan.strategy not in seen:
            seen.add(est.plan.strategy)
            out.append(est)
    return out


def check_fits(estimates: list[Estimate], limit_gb: float | None) -> None:
    """Raise :class:`ConfigError` naming the smallest memory that would fit when no plan fits ``limit_gb``."""
    runnable = [e for e in estimates if e.applicable]
    if runnable and not any(e.feasible for e in runnable):
        smallest = min(runnable, key=lambda e: e.peak_bytes)
        raise ConfigError(f"no plan fits in {limit_gb:g} GB per device; the smallest needs "
                          f"{smallest.peak_bytes / 2**30:.3f} GB ({smallest.plan.label}): raise --memory-limit")

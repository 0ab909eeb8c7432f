"""Search: enumerate every strategy with its parameters, price each plan, rank by predicted step time.

What is enumerated for ``N`` ranks and global batch ``B``:

* ``single``; ``ddp`` on ``p = 2..N`` ranks with each all-reduce (PyTorch's ``ddp`` and the kit's
  schedules), keeping the cheapest (``ddp`` on ties: it is the library's); ``hybrid`` and
  ``tensor-parallel`` on ``p = 2..N``; ``zero`` stages 1, 2, 3 and ``fsdp`` (resharding or not) on
  ``p = 2..N``; ``ps`` (synchronous) on ``p = 2..N`` ranks with ``S = 1..p − 1`` servers and ``W = p − S``
  workers dividing ``B``;
* ``pipeline`` on ``p = 2..N`` stages, ``gpipe`` and ``model-parallel`` on ``k = 2..N`` partitions, with
  ``m ∈ {1, 2, 4, …, 32}`` micro-batches dividing ``B`` (``m = 1`` only for model-parallel), the gpipe
  schedule (and 1f1b where gpipe's does not fit in memory);
* the split points (balance) of each pipeline: **exhaustive** over all ``C(L − 1, p − 1)`` contiguous
  splits when there are at most :data:`EXHAUSTIVE_SPLITS`, each priced whole (compute, messages at the cut,
  memory); beyond that a **heuristic**: the exact min-max dynamic programme over layer groups on stage
  times ``T_{stage}(B/m)`` (:func:`labkit.strategies.model_parallel.partition`), which ignores the cut's
  message size.

Infeasible plans (too much memory per device) stay in the list, marked, below the feasible ones.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

from labkit.advisor.plan import Estimate, Plan
from labkit.advisor.pricing import PRICERS, price
from labkit.advisor.profile import Profile
from labkit.advisor.topology import Topology
from labkit.collectives.registry import ALGORITHMS
from labkit.errors import ConfigError

EXHAUSTIVE_SPLITS = 2000
MICROBATCHES = (1, 2, 4, 8, 16, 32)
ONE_PROCESS = ("single", "gpipe", "model-parallel")


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


def candidates(prof_for: Callable[[int], Profile], topo: Topology, batch: int,
               strategies: tuple[str, ...] | None = None) -> list[Estimate]:
    """Every plan priced, best first. ``prof_for(processes)`` gives the profile at that many processes' threads."""
    names = [s for s in (strategies or PRICERS) if s in PRICERS]
    n_layers = len(prof_for(1).layers)
    out: list[Estimate] = []

    def add(plan: Plan) -> Estimate:
        return price(plan, prof_for(plan.processes), topo)

    for name in names:
        if name == "single":
            out.append(add(Plan("single", 1, 1, batch)))
            continue
        for p in range(2, topo.ranks + 1):
            if name in ("ddp", "hybrid", "tensor-parallel", "zero", "fsdp") and batch % p:
                continue
            if name == "zero":
                out += [add(Plan("zero", p, p, batch, (("zero_stage", stage),))) for stage in (1, 2, 3)]
            elif name == "fsdp":
                out += [add(Plan("fsdp", p, p, batch, (("fsdp_no_reshard", keep),))) for keep in (False, True)]
            elif name == "ps":
                out += [add(Plan("ps", p, p, batch, (("ps_servers", s),))) for s in range(1, p)
                        if batch % (p - s) == 0]
            elif name == "ddp":
                options = [add(Plan("ddp", p, p, batch, (("allreduce", a),))) for a in ("ddp", *ALGORITHMS)]
                out.append(min(options, key=lambda e: e.step_s))
            elif name in ("hybrid", "tensor-parallel"):
                out.append(add(Plan(name, p, p, batch)))
            elif p <= n_layers:
                out += _pipelines(name, p, batch, prof_for, add)
    if not out:
        raise ConfigError("no strategy to search: give at least one of " + ", ".join(PRICERS))
    return sorted(out, key=_rank_key)


def _pipelines(name: str, p: int, batch: int, prof_for, add) -> list[Estimate]:
    procs = 1 if name in ONE_PROCESS else p
    prof = prof_for(procs)
    found = []
    for m in MICROBATCHES:
        if batch % m or m > batch or (m == 1 and name != "model-parallel") or (m > 1 and name == "model-parallel"):
            continue

        def make(balance, schedule="gpipe"):
            if name == "pipeline":
                opts = (("num_microbatches", m), ("balance", balance)) + ((("schedule", schedule),)
                                                                          if schedule != "gpipe" else ())
            elif name == "gpipe":
                opts = (("num_microbatches", m), ("partitions", p), ("balance", balance))
            else:
                opts = (("mp_split_points", tuple(itertools.accumulate(balance[:-1]))),)
            return add(Plan(name, procs, p, batch, opts))

        est = best_balance(make, prof, p, batch / m)
        if name == "pipeline" and not est.feasible and m >= p:
            est = min(est, best_balance(lambda b: make(b, "1f1b"), prof, p, batch / m), key=_rank_key)
        found.append(est)
    return found


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

"""The mesh search: every ``dp×tp×pp×cp`` mesh of a GPT (``dp×ep`` for a mixture of experts), every ``dp×pp``
mesh of a CNN, on a topology's devices, with micro-batch counts, ZeRO stages (and for a GPT sequence parallelism
and recomputation), each priced by :func:`labkit.parallel.pricing.price_mesh` (the dimensions' own formulas) and
pruned by memory per device; the frontier of memory against time, and why the best plan wins, in words.
"""
from __future__ import annotations

import itertools

from labkit.advisor.plan import Estimate, MeshPlan, Profile
from labkit.advisor.search import MICROBATCHES
from labkit.advisor.topology import Topology
from labkit.parallel.pricing import GPTShape, price_mesh

GB, MB = 2**30, 2**20


def _valid(plan: MeshPlan, model: GPTShape | Profile, batch: int) -> bool:
    """What the dimensions accept: a CNN dp and pp (at most one stage per layer); a GPT's tp divides the heads, pp
    the blocks, 2·cp the sequence (zig-zag), cp and pp not together, ep the experts (a MoE takes only dp and ep),
    SP only with tp; ``dp·ep·m`` divides the batch, ``m ≥ pp`` with a pipeline (else 1), ZeRO only where ranks
    hold the same weights."""
    p = plan
    if isinstance(model, Profile):
        shape = p.tp == p.cp == p.ep == 1 and not p.sequence_parallel and not p.recompute and p.pp <= len(model.layers)
    else:
        g = model
        shape = ((p.tp == p.pp == p.cp == 1 and g.n_expert % p.ep == 0 if g.n_expert else p.ep == 1)
                 and g.n_head % p.tp == 0 and g.n_layer % p.pp == 0 and g.seq % (2 * p.cp) == 0
                 and not (p.cp > 1 and p.pp > 1) and (not p.sequence_parallel or p.tp > 1))
    return (shape and batch % (p.dp * p.ep * p.microbatches) == 0
            and (p.microbatches >= p.pp if p.pp > 1 else p.microbatches == 1) and (p.zero == 0 or p.dp * p.cp * p.ep > 1))


def meshes(devices: int, model: GPTShape | Profile, batch: int) -> list[MeshPlan]:
    """Every valid plan using all ``devices``: ``dp·tp·pp·cp·ep = N`` over its divisors."""
    out = []
    divisors = [k for k in range(1, devices + 1) if devices % k == 0]
    for tp, pp, cp, ep in itertools.product(divisors, repeat=4):
        if devices % (tp * pp * cp * ep):
            continue
        dp = devices // (tp * pp * cp * ep)
        for m, zero, sp, rc in itertools.product(MICROBATCHES, range(4), (False, True), (False, True)):
            plan = MeshPlan(dp, tp, pp, cp, m, zero, sp, rc, ep)
            if _valid(plan, model, batch):
                out.append(plan)
    return out


def _key(e: Estimate) -> tuple:
    return (not e.feasible, e.step_s, e.peak_bytes, e.plan.label)


def search(model: GPTShape | Profile, topo: Topology, batch: int, devices: int | None = None) -> list[Estimate]:
    """Every plan of :func:`meshes` priced, best first (plans that do not fit last)."""
    return sorted((price_mesh(p, model, topo, batch) for p in meshes(devices or topo.ranks, model, batch)), key=_key)


def frontier(estimates: list[Estimate]) -> list[Estimate]:
    """The feasible plans no other beats on both step time and memory (fastest first)."""
    out: list[Estimate] = []
    for e in sorted((e for e in estimates if e.feasible), key=_key):
        if not out or e.peak_bytes < out[-1].peak_bytes:
            out.append(e)
    return out


def size(nbytes: float) -> str:
    """``12 GB`` at a gigabyte or more, else ``3.4 MB``."""
    return f"{nbytes / GB:.0f} GB" if nbytes >= GB else f"{nbytes / MB:.1f} MB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2g} ms"


def explain(estimates: list[Estimate], model: GPTShape | Profile, topo: Topology) -> str:
    """Why the best plan wins, in words: the faster plan that does not fit (if one is faster), then against
    the best plan of each of the next mesh shapes, the term that decides, or the memory that rules it out."""
    what = (f"{model.model} on {model.dataset}" if isinstance(model, Profile)
            else f"a {model.name} GPT at sequence {model.seq}")
    best, limit = estimates[0], size(topo.memory_bytes)
    if not best.feasible:
        return f"on {topo.name}, no plan for {what} fits in memory"
    seen, reasons = {_shape(best.plan)}, []
    fastest = min(estimates, key=lambda e: e.step_s)
    if not fastest.feasible:
        reasons.append(f"the faster {fastest.plan.label} ({ms(fastest.step_s)}) needs {size(fastest.peak_bytes)} "
                       f"per device (> {limit})")
    for e in estimates:
        if _shape(e.plan) in seen:
            continue
        seen.add(_shape(e.plan))
        if not e.feasible:
            reasons.append(f"{e.plan.label} needs {size(e.peak_bytes)} per device (> {limit})")
        else:
            term = max(e.time, key=lambda k: e.time[k] - best.time.get(k, 0.0))
            reasons.append(f"{e.plan.label} is {(e.step_s / best.step_s - 1):.0%} slower ({term} "
                           f"{ms(e.time[term])} against {ms(best.time.get(term, 0.0))})")
        if len(reasons) >= 3:
            break
    return (f"on {topo.name}, {what}: {best.plan.label} ({ms(best.step_s)}/step, {size(best.peak_bytes)} per "
            "device) because " + ("; ".join(reasons) or "it is the only mesh"))


def _shape(plan: MeshPlan) -> tuple:
    return plan.dp, plan.tp, plan.pp, plan.cp, plan.ep

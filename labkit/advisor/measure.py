"""The advisor's one timing helper (:func:`timed`) and its fit of this machine's links (:func:`measure_link`); the
model's side is :mod:`labkit.advisor.profile`.

Per kind of collective a plan makes (:data:`labkit.advisor.alphabeta.KINDS`: one ring step of point-to-point
messages, as the kit's schedules run them, and PyTorch's ``all_reduce``, ``reduce_scatter``, ``all_gather``,
``broadcast``), spawned gloo ranks at a plan's threads time it at each of :data:`FIT_SIZES` bytes as a training
step makes it: windows of :data:`CALLS` calls, each after :data:`WORK_S` of matrix products, less a window of the
products alone just before; the median of :data:`WINDOWS` such pairs, on the slowest rank. Sizes lost in the
computing's noise are left out; a kind left with fewer than two sizes pays the point-to-point link. The points
give each kind's α and β (:func:`fit_kind`), the same for every strategy; γ is the fastest of 5 ``a += b``. The
fit is cached as a run with one ``"cost-model"`` record (as ``labkit allreduce bench --out DIR`` writes it).
"""
from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist

from labkit import dist as kdist
from labkit.advisor.alphabeta import KINDS, ring_counts
from labkit.collectives.cost import CostModel, fit_alpha_beta
from labkit.results import RunWriter, load_run
from labkit.testing import run_ranks

FIT_SIZES = [4, 16 << 10, 256 << 10, 1 << 20]  # bytes: latency-bound to bandwidth-bound (the fit takes seconds)
CALLS, WINDOWS, WORK_S = 5, 5, 0.01  # calls per window, windows per size and kind, computing before each call


def _models(fit: dict) -> tuple[CostModel, dict]:
    return (CostModel(fit["alpha"], fit["beta"], fit.get("gamma", 0.0)),
            {k: CostModel(v["alpha"], v["beta"]) for k, v in fit.get("kinds", {}).items()})


def read_fit(path: str | Path, ranks: int) -> tuple[CostModel, dict] | None:
    """``(link, kinds)``: the α-β-γ fit for ``ranks`` ranks cached at ``path`` by :func:`measure_link`, with its
    fits per kind of collective (None if there is none; one rank has no link: all zero)."""
    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0), {}
    try:
        fits = {r["world_size"]: r for r in load_run(path).records_of("cost-model")}
    except (FileNotFoundError, ValueError):
        return None
    return _models(fits[ranks]) if ranks in fits else None


def timed(fn, windows: int, quantile: float = 0.5, window_s: float = 0.0, setup=None, calls: int = 0) -> float:
    """Seconds per call of ``fn``: the ``quantile`` (0.5 the median, 0 the fastest) of ``windows`` windows of
    back-to-back calls. A window holds ``calls`` calls (ranks timing collectives: the same calls on every rank) or,
    when 0, as many as fill ``window_s`` (at least one), counted by one untimed call first. ``setup()``, untimed,
    runs before each window; ``fn`` gets what it returns."""
    state = setup() if setup else None

    def call():
        return fn(state) if setup else fn()

    if not calls:
        start = perf_counter()
        call()
        calls = max(1, math.ceil(window_s / max(perf_counter() - start, 1e-6)))
    times = []
    for _ in range(windows):
        state = setup() if setup else None
        start = perf_counter()
        for _ in range(calls):
            call()
        times.append((perf_counter() - start) / calls)
    return sorted(times)[round(quantile * (len(times) - 1))]


def fit_kind(kind: str, points, ranks: int) -> tuple[float, float]:
    """``(α, β)`` per message and per byte of a ``kind`` collective over ``ranks`` ranks from ``points``
    ``[(buffer bytes n, seconds), ...]``: the line ``T(n) = a + c·n`` through them
    (:func:`labkit.collectives.cost.fit_alpha_beta`), ``α = a / m``, ``β = c / s`` with ``(m, s)`` the kind's
    ring counts, messages and share of ``n`` a rank sends (:func:`labkit.advisor.alphabeta.ring_counts`)."""
    a, c = fit_alpha_beta(*zip(*points))
    messages, share = ring_counts(kind, ranks)
    return a / messages, c / share


def _fit_rank(env, windows: int = WINDOWS, calls: int = CALLS) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))  # as the plans' ranks run
    rank, p = env.rank, env.world_size
    device = kdist.comm_device()  # NCCL takes CUDA tensors only

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    m = torch.randn(128, 128, device=device)
    reps = torch.tensor([max(1, round(WORK_S / timed(lambda: (m @ m, sync()), 5, 0.5, window_s=0.01)))])
    kdist.all_reduce(reps, op=dist.ReduceOp.MIN)  # the same work on every rank
    reps = int(reps.item())

    def work() -> None:  # what a step computes between two collectives
        for _ in range(reps):
            m @ m
        sync()

    points: dict[str, list] = {kind: [] for kind in KINDS}
    for nbytes in FIT_SIZES:
        n = max(p, nbytes // 4 // p * p)  # elements, divisible by p
        full, send, recv = torch.zeros(n, device=device), torch.zeros(n, device=device), torch.empty(n, device=device)
        shard = torch.zeros(n // p, device=device)

        def ring_step():
            ops = [dist.P2POp(dist.irecv, recv, (rank - 1) % p), dist.P2POp(dist.isend, send, (rank + 1) % p)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        collective = {"p2p": ring_step, "all_reduce": lambda: dist.all_reduce(full),
                      "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
                      "all_gather": lambda: dist.all_gather_single(full, shard),
                      "broadcast": lambda: dist.broadcast(full, 0)}
        for kind in KINDS:
            def once(_, call=collective[kind]):
                work()
                call()
                sync()

            extra = []
            for _ in range(windows):  # paired windows: a slow spell of the machine falls on both
                alone = timed(lambda _: work(), 1, setup=dist.barrier, calls=calls)
                extra.append(timed(once, 1, setup=dist.barrier, calls=calls) - alone)
            slowest = torch.tensor(statistics.median(extra), dtype=torch.float64)
            kdist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if slowest.item() > 0 or kind == "p2p":  # a cost lost in the computing's noise says nothing
                points[kind].append((n * 4, max(slowest.item(), 1e-6)))
    fitted = {kind: dict(zip(("alpha", "beta"), fit_kind(kind, points[kind], p))) for kind in KINDS
              if len(points[kind]) >= 2 or kind == "p2p"}
    a, b = torch.zeros(1 << 20), torch.ones(1 << 20)
    gamma = torch.tensor(timed(lambda: a.add_(b), 5, 0.0) / (a.numel() * 4), dtype=torch.float64)
    kdist.all_reduce(gamma)
    return {**fitted["p2p"], "gamma": gamma.item() / p, "p2p": points["p2p"],
            "kinds": {k: v for k, v in fitted.items() if k != "p2p"}}


def measure_link(ranks: int, out: Path, windows: int = WINDOWS, calls: int = CALLS) -> tuple[CostModel, dict]:
    """Fit α-β-γ and the kinds' α-β on ``ranks`` spawned gloo ranks now (``windows`` pairs of ``calls`` calls per
    size and kind: fewer is quicker and noisier); cache it at ``out`` (the bench's record format)."""
    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0), {}
    fit = run_ranks(_fit_rank, ranks, windows, calls, timeout=300)[0]
    writer = RunWriter(out)
    writer.log({"kind": "cost-model", "world_size": ranks, **fit})
    summary = {k: fit[k] for k in ("alpha", "beta", "gamma", "kinds")}
    writer.finish(f"links {ranks}", "cost-model", {"ranks": ranks}, summary)
    return _models(fit)

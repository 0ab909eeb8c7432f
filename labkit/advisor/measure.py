"""What the advisor measures on this machine, with one timing helper (:func:`timed`): α, β, γ of the links
here, per kind of collective, and (:mod:`labkit.advisor.profile`) the model's layers and steps.

Every strategy pays the same prices for its messages and bytes (:mod:`labkit.advisor.alphabeta`); nothing is
fitted per strategy. The link fit runs in spawned gloo ranks with the threads a plan's ranks get. For each kind
of collective a plan makes (:data:`labkit.advisor.alphabeta.KINDS`: one ring step of point-to-point messages, as
the kit's own schedules run them, and PyTorch's ``all_reduce``, ``reduce_scatter``, ``all_gather`` and
``broadcast``), every rank times it at each of :data:`FIT_SIZES` bytes as a training step makes it: in windows of
:data:`CALLS` calls, each after :data:`WORK_S` (10 ms) of matrix products on every rank, less a window of the
products alone just before; the median of :data:`WINDOWS` such pairs on the slowest rank (sizes whose cost is
lost in the computing's noise are left out; a kind with fewer than two sizes left pays the point-to-point link). Not one call just after a barrier,
nor calls back to back: what a collective costs grows with the computing before it (the ranks' threads go to
sleep, the ranks drift apart). On 2 gloo ranks of a 2-core machine an all-reduce of 4 bytes took 0.3 ms back to
back, 0.9 ms after 1 ms of computing and 2.2 ms after 10 ms; one of 245 KB (LeNet's gradients) 2.2, 2.3 and
3.2 ms; the fastest single all-reduce of 1 MB 0.7 ms, back-to-back ones 2.4 ms each. The least-squares line
through them (:func:`labkit.collectives.cost.fit_alpha_beta`), ``T(n) = a + c·n``, divided by the collective's
ring counts (:func:`labkit.advisor.alphabeta.ring_counts`: messages and the share of ``n`` a rank sends), gives
that kind's α and β per message and byte (:func:`fit_kind`). γ is the fastest of 5 ``a += b``. The kinds differ:
on the same machine a 512 KB reduce-scatter took 2.6 ms and one ring step of as many bytes 0.4 ms. The fit is
cached as a run in the results schema (one ``"cost-model"`` record, as ``labkit allreduce bench --out DIR``
writes them, with the kinds beside).
"""
from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from time import perf_counter

from labkit.collectives.cost import CostModel
from labkit.errors import ConfigError

#: message sizes of the fit: from latency-bound to bandwidth-bound, small enough to take seconds
FIT_SIZES = [4, 16 << 10, 256 << 10, 1 << 20]
#: calls of a collective in each of :data:`WINDOWS` timed windows, each after :data:`WORK_S` of computing, as a
#: training step makes them (after a layer's or a whole backward's work, not back to back)
CALLS, WINDOWS, WORK_S = 5, 5, 0.01


def read_fit(path: str | Path, ranks: int, required: bool = True) -> tuple[CostModel, dict] | None:
    """``(link, kinds)``: the α-β-γ fit for ``ranks`` ranks from a run with ``"cost-model"`` records and the fits
    per kind of collective where the record has them (None if absent and not ``required``; one rank has no link:
    all zero)."""
    from labkit.results import load_run

    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0), {}
    try:
        run = load_run(path)
    except (FileNotFoundError, ValueError) as exc:
        if required:
            raise ConfigError(f"--links {path}: {exc}; write one with `labkit allreduce bench --out {path}`") from None
        return None
    fits = {r["world_size"]: r for r in run.records_of("cost-model")}
    if ranks not in fits:
        if required:
            raise ConfigError(f"--links {path} has fits for {sorted(fits)} rank(s), not {ranks}; "
                              f"run `labkit allreduce bench --ranks {ranks} --out {path}`")
        return None
    fit = fits[ranks]
    kinds = {k: CostModel(v["alpha"], v["beta"]) for k, v in fit.get("kinds", {}).items()}
    return CostModel(fit["alpha"], fit["beta"], fit.get("gamma", 0.0)), kinds


def timed(fn, windows: int, quantile: float = 0.5, window_s: float = 0.0, setup=None, calls: int = 0) -> float:
    """Seconds per call of ``fn``, the one timing helper of the advisor: ``windows`` windows of back-to-back calls
    (as a loop makes them), each at least ``window_s`` long (one call when 0: a window shorter than a scheduler
    time slice is all luck on a shared machine), after one untimed call; or, with ``calls``, that many calls per
    window and no untimed call (what ranks timing a function that makes collectives need: the same calls on
    every rank); the ``quantile`` over the windows (0.5 the median, 0.25 the lower quartile: other programs only
    ever slow a window down; 0 the fastest).
    ``setup()``, untimed, runs before each window and ``fn`` gets what it returns."""
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
    """``(α, β)`` per message and per byte of a collective of ``kind`` over ``ranks`` ranks from ``points``
    ``[(buffer bytes n, seconds), ...]``: the line ``T(n) = a + c·n`` through them
    (:func:`labkit.collectives.cost.fit_alpha_beta`), ``α = a / m`` and ``β = c / s`` with ``(m, s)`` the kind's
    ring counts (:func:`labkit.advisor.alphabeta.ring_counts`)."""
    from labkit.advisor.alphabeta import ring_counts
    from labkit.collectives.cost import fit_alpha_beta

    a, c = fit_alpha_beta(*zip(*points))
    messages, share = ring_counts(kind, ranks)
    return a / messages, c / share


def _fit_rank(env, windows: int = WINDOWS, calls: int = CALLS) -> dict:
    import torch
    import torch.distributed as dist

    from labkit import dist as kdist
    from labkit.advisor.alphabeta import KINDS

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))  # as the plans' ranks run
    rank, p = env.rank, env.world_size
    device = kdist.comm_device()  # NCCL takes CUDA tensors only

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    m = torch.randn(128, 128, device=device)
    reps = torch.tensor([max(1, round(WORK_S / timed(lambda: (m @ m, sync()), 5, 0.5, window_s=0.01)))])
    kdist.all_reduce(reps, op=dist.ReduceOp.MIN)  # the same work on every rank

    def work() -> None:  # what a step computes between two collectives
        for _ in range(int(reps.item())):
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
    # a kind with fewer than two sizes above the noise pays the point-to-point link
    fitted = {kind: dict(zip(("alpha", "beta"), fit_kind(kind, points[kind], p))) for kind in KINDS
              if len(points[kind]) >= 2 or kind == "p2p"}
    a = torch.zeros(1 << 20)
    b = torch.ones_like(a)
    gamma = torch.tensor(timed(lambda: a.add_(b), 5, 0.0) / (a.numel() * 4), dtype=torch.float64)
    kdist.all_reduce(gamma)
    return {**fitted["p2p"], "gamma": gamma.item() / p, "p2p": points["p2p"],
            "kinds": {k: v for k, v in fitted.items() if k != "p2p"}}


def measure_link(ranks: int, out: Path, windows: int = WINDOWS, calls: int = CALLS) -> tuple[CostModel, dict]:
    """Fit α-β-γ and the kinds' α-β on ``ranks`` spawned gloo ranks now (``windows`` pairs of ``calls`` calls per
    size and kind: fewer is quicker and noisier); cache it at ``out`` (the bench's record format)."""
    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0), {}
    from labkit.results import RunWriter
    from labkit.testing import run_ranks

    fit = run_ranks(_fit_rank, ranks, windows, calls, timeout=300)[0]
    writer = RunWriter(out)
    writer.log({"kind": "cost-model", "world_size": ranks, **fit})
    writer.finish(f"links {ranks}", "cost-model", {"ranks": ranks},
                  {"alpha": fit["alpha"], "beta": fit["beta"], "gamma": fit["gamma"], "kinds": fit["kinds"]})
    return CostModel(fit["alpha"], fit["beta"], fit["gamma"]), {k: CostModel(v["alpha"], v["beta"])
                                                               for k, v in fit["kinds"].items()}

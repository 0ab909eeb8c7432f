"""What the advisor measures on this machine, with one timing helper (:func:`timed`): α, β, γ of the links
here, and (:mod:`labkit.advisor.profile`) the model's layers and steps.

Every strategy pays the links' prices for its messages and bytes (:mod:`labkit.advisor.alphabeta`); nothing is
fitted per strategy. The link fit: every rank sends :data:`FIT_SIZES` bytes to the next while receiving from the
previous (one ring step, as every schedule's steps run), the lower quartile of 9 rounds per size on the slowest
rank (on a shared virtual machine the latency has slow spells lasting seconds, which only ever slow a round
down), α and β the least-squares line through them (:func:`labkit.collectives.cost.fit_alpha_beta`), γ the
fastest of 5 ``a += b``; run in spawned gloo ranks with the threads a plan's ranks get. The fit is cached as a run in the results schema (one ``"cost-model"`` record, as
``labkit allreduce bench --out DIR`` writes them).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from time import perf_counter

from labkit.collectives.cost import CostModel
from labkit.errors import ConfigError

#: message sizes of the fit: from latency-bound to bandwidth-bound, small enough to take seconds
FIT_SIZES = [4, 16 << 10, 256 << 10, 1 << 20]


def read_fit(path: str | Path, ranks: int, required: bool = True) -> CostModel | None:
    """The α-β-γ fit for ``ranks`` ranks from a run with ``"cost-model"`` records (None if absent and not
    ``required``; one rank has no link: all zero)."""
    from labkit.results import load_run

    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0)
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
    return CostModel(fit["alpha"], fit["beta"], fit.get("gamma", 0.0))


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


def _fit_rank(env) -> dict:
    import torch
    import torch.distributed as dist

    from labkit import dist as kdist
    from labkit.collectives.cost import fit_alpha_beta

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))  # as the plans' ranks run
    rank, p, points = env.rank, env.world_size, []
    device = kdist.comm_device()  # NCCL takes CUDA tensors only

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for nbytes in FIT_SIZES:
        send = torch.zeros(max(1, nbytes // 4), device=device)
        recv = torch.empty_like(send)

        def ring_step(_):
            ops = [dist.P2POp(dist.irecv, recv, (rank - 1) % p), dist.P2POp(dist.isend, send, (rank + 1) % p)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            sync()

        slowest = torch.tensor(timed(ring_step, 9, 0.25, setup=dist.barrier), dtype=torch.float64)
        kdist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        points.append((send.numel() * 4, slowest.item()))
    alpha, beta = fit_alpha_beta(*zip(*points))
    a = torch.zeros(1 << 20)
    b = torch.ones_like(a)
    gamma = torch.tensor(timed(lambda: a.add_(b), 5, 0.0) / (a.numel() * 4), dtype=torch.float64)
    kdist.all_reduce(gamma)
    return {"alpha": alpha, "beta": beta, "gamma": gamma.item() / p, "p2p": points}


def measure_link(ranks: int, out: Path) -> CostModel:
    """Fit α-β-γ on ``ranks`` spawned gloo ranks now; cache it at ``out`` (the bench's record format)."""
    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0)
    from labkit.results import RunWriter
    from labkit.testing import run_ranks

    fit = run_ranks(_fit_rank, ranks, timeout=300)[0]
    writer = RunWriter(out)
    writer.log({"kind": "cost-model", "world_size": ranks, **fit})
    writer.finish(f"links {ranks}", "cost-model", {"ranks": ranks},
                  {"alpha": fit["alpha"], "beta": fit["beta"], "gamma": fit["gamma"]})
    return CostModel(fit["alpha"], fit["beta"], fit["gamma"])

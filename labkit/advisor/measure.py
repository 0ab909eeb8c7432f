"""What the advisor measures on this machine's links: α, β, γ once, from a few message sizes.

Every strategy pays these prices for its messages and bytes (:mod:`labkit.advisor.alphabeta`); nothing is fitted
per strategy. The fit is :func:`labkit.collectives.cost.fit_cost_model` (point-to-point times of
:data:`FIT_SIZES`, the lower quartile of 9 rounds per size: on a shared virtual machine the latency has slow
spells lasting seconds, which only ever slow a round down), run in spawned gloo ranks with the threads a plan's
ranks get; ``rounds`` fits give each number's median. The fit is cached as a run in the results schema (one
``"cost-model"`` record, as ``labkit allreduce bench --out DIR`` writes them).
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

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


def _fit_rank(env) -> dict:
    import torch

    from labkit.collectives.cost import fit_cost_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))  # as the plans' ranks run
    model, points = fit_cost_model(FIT_SIZES, repeats=9, quantile=0.25)
    return {"alpha": model.alpha, "beta": model.beta, "gamma": model.gamma, "p2p": points}


def median_fit(fits: list[dict]) -> dict:
    """One fit from several rounds: the median of α, β and γ; the first round's measured points."""
    out = {key: statistics.median(f[key] for f in fits) for key in ("alpha", "beta", "gamma")}
    return {**out, "p2p": fits[0]["p2p"], "rounds": len(fits)}


def measure_link(ranks: int, out: Path, rounds: int = 1) -> CostModel:
    """Fit α-β-γ on ``ranks`` spawned gloo ranks now (``rounds`` times, the median: :func:`median_fit`);
    cache it at ``out`` (the bench's record format)."""
    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0)
    from labkit.results import RunWriter
    from labkit.testing import run_ranks

    fit = median_fit([run_ranks(_fit_rank, ranks, timeout=300)[0] for _ in range(max(1, rounds))])
    writer = RunWriter(out)
    writer.log({"kind": "cost-model", "world_size": ranks, **fit})
    writer.finish(f"links {ranks}", "cost-model", {"ranks": ranks},
                  {"alpha": fit["alpha"], "beta": fit["beta"], "gamma": fit["gamma"]})
    return CostModel(fit["alpha"], fit["beta"], fit["gamma"])

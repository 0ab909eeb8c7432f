"""Validate: run **every** feasible plan of the table through ``labkit train`` (torchrun underneath) at least
three times, and judge the prediction by its **ranking**.

The runs go round-robin (plan 1, 2, …, n, then again), so that a shared machine's slow spell falls on several
plans rather than on all the repeats of one. A run's step is ``global batch / samples per second`` of the
training loop's own meter (it skips the first step: allocation and schedule set-up are not throughput); a
plan's measured step is the median of its runs, its **spread** ``(max − min) / median``. The figures of merit
(:func:`ranking`):

* Spearman's ρ between predicted and measured steps over all plans (1: the same order);
* ``measured(predicted best) / measured best``: what trusting the advisor costs (1: it chose the fastest).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

from labkit.advisor.advise import Advice

GB = 2**30


def run_args(advice: Advice, label: str, out: Path, steps: int) -> list[str]:
    """The ``labkit train`` arguments a validation run of plan ``label`` uses: the plan's command, with its
    checkpoint as the command has it (the training loop's stop check comes with it), for ``steps``
    steps, a small test set, its own ``--out``."""
    plan = advice.find(label).plan
    return [*plan.train_args(advice.model, advice.dataset), *advice.train_args, "--epochs", "1",
            "--max-steps", str(steps), "--test-size", "64", "--device", advice.topology.device,
            "--log-every", "1000", "--out", str(out)]


def ranks_of(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank: ``[3, 1, 3] -> [2.5, 1, 2.5]``."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's ρ: the Pearson correlation of the ranks (nan for fewer than 2 values or a constant list)."""
    rx, ry = ranks_of(x), ranks_of(y)
    n = len(x)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


def ranking(advice: Advice) -> dict:
    """``{"plans", "spearman", "best_ratio"}`` over the plans of the table with a measured step:
    ``best_ratio`` = measured step of the predicted best / the best measured step."""
    rows = [(e.step_s, advice.measured[e.plan.label]["step_s"]) for e in advice.table
            if "step_s" in advice.measured.get(e.plan.label, {})]
    if not rows:
        return {"plans": 0, "spearman": float("nan"), "best_ratio": float("nan")}
    predicted, measured = zip(*rows)
    chosen = measured[min(range(len(rows)), key=predicted.__getitem__)]
    return {"plans": len(rows), "spearman": spearman(list(predicted), list(measured)),
            "best_ratio": chosen / min(measured)}


def validate(advice: Advice, repeats: int = 3, steps: int = 8, out: str | Path = Path("runs") / "advise",
             echo: Callable[[str], None] | None = None, progress: bool = True,
             extra: tuple[str, ...] = (), processes: int | None = None,
             record: Callable[[str, dict], None] | None = None) -> dict[str, dict]:
    """Run every feasible plan of ``advice.table`` ``repeats`` times, round-robin; fill ``advice.measured``.

    ``processes``: only plans on this many processes. ``extra``: more ``labkit train`` arguments (e.g.
    ``("--base-lr", "0.005")`` for AlexNet). A plan whose run fails gets ``{"error": its line, "run"}``
    instead of numbers, and its other runs are skipped. ``record(label, metrics)`` is called after each run
    (a benchmark writes them as they come).

    Returns:
        ``{plan label: {"step_s" (median), "steps_s" (each run), "spread", "samples_per_s", "peak_bytes",
        "ratio" (measured / predicted step), "memory_ratio", "final_train_loss", "run"}}``.
    """
    from labkit.launch import RunFailed, torchrun

    chosen = [e for e in advice.table if e.feasible and processes in (None, e.plan.processes)]
    runs: dict[str, list[dict]] = {e.plan.label: [] for e in chosen}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chosen) * repeats, desc="validating plans", leave=False)
    for r in range(max(1, repeats)):
        for i, est in enumerate(chosen):
            label = est.plan.label
            if bar is not None:
                bar.update()
            if label in advice.measured and "error" in advice.measured[label]:
                continue
            run_dir = Path(out) / f"plan{i}-{est.plan.strategy}-{r}"
            try:
                run = torchrun([*run_args(advice, label, run_dir, steps), *extra], nproc=est.plan.processes,
                               echo=echo)
            except RunFailed as exc:  # one plan failing (e.g. a diverging loss) must not hide the others'
                lines = str(exc).splitlines()
                why = next((line for line in lines if line.startswith("labkit: error: ")), lines[-1])
                advice.measured[label] = {"error": why[:300], "run": str(run_dir)}
                continue
            runs[label].append({**run.summary["metrics"], "run": str(run_dir)})
            if record is not None:
                record(label, runs[label][-1])
    if bar is not None:
        bar.close()
    for est in chosen:
        done = runs[est.plan.label]
        if not done or "error" in advice.measured.get(est.plan.label, {}):
            continue
        steps_s = [est.plan.batch_size / m["samples_per_sec"] for m in done]
        step = statistics.median(steps_s)
        peak = max(m["peak_memory_gb"] for m in done) * GB
        advice.measured[est.plan.label] = {
            "step_s": step, "steps_s": steps_s, "spread": (max(steps_s) - min(steps_s)) / step,
            "samples_per_s": est.plan.batch_size / step, "peak_bytes": peak, "ratio": step / est.step_s,
            "memory_ratio": peak / est.peak_bytes, "final_train_loss": done[-1]["final_train_loss"],
            "run": done[-1]["run"]}
    return advice.measured

"""Run every feasible plan of the table (:func:`validate`), judge the **ranking** and name the term a plan is off by."""
from __future__ import annotations

import contextlib
import io
import statistics
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from labkit.advisor.plan import Advice
from labkit.advisor.topology import GB
from labkit.dist.testing import run_ranks
from labkit.train.cli import config_from_argv
from labkit.train.meters import interactive
from labkit.train.run import run


def ranking(advice: Advice) -> dict:
    """Over the measured plans: Spearman's ρ of predicted and measured steps (SciPy's; nan where either side is
    all equal) and ``best_ratio`` = measured step of the predicted best / the best measured step."""
    rows = [(e.step_s, m["step_s"]) for e in advice.table if "step_s" in (m := advice.measured.get(e.plan.label, {}))]
    if not rows:
        return {"plans": 0, "spearman": float("nan"), "best_ratio": float("nan")}
    from scipy.stats import spearmanr  # a second's import: only where a table was measured
    predicted, measured = zip(*rows)
    rho = spearmanr(predicted, measured).statistic if min(len(set(predicted)), len(set(measured))) > 1 else float("nan")
    return {"plans": len(rows), "spearman": float(rho), "best_ratio": min(rows, key=lambda r: r[0])[1] / min(measured)}


def off_terms(advice: Advice, tolerance: float = 0.25) -> list[str]:
    """A line per measured plan whose ``measured / predicted`` is off the plans' median ``r`` by over ``tolerance`` and
    its spread: the residual ``measured − r·predicted`` against its largest term not all plans pay (else compute)."""
    rows = [(e, m) for e in advice.table if "step_s" in (m := advice.measured.get(e.plan.label, {}))]
    if len(rows) < 3:
        return []
    r = statistics.median(m["ratio"] for _, m in rows)
    out = []
    for e, m in rows:
        if abs(m["ratio"] / r - 1) > max(tolerance, m["spread"]):
            residual = m["step_s"] - r * e.step_s
            term = max((k for k in e.time if k not in ("compute", "update", "data")), key=e.time.get, default="compute")
            head = f"{e.plan.label}: measured {m['ratio']:.2f}x its prediction (the plans' median {r:.2f}x): "
            priced = f"its {term} term ({r * e.time[term] * 1e3:.1f} ms at the median ratio)"
            out.append(head + (f"+{residual * 1e3:.1f} ms that {priced} does not price" if residual > 0 else
                               f"{priced} prices {-residual * 1e3:.1f} ms the run did not spend"))
    return out


def train_runs(env, jobs: list[tuple[str, object, int]]) -> list[tuple[str, dict]]:
    """On one rank: each ``(label, TrainConfig, threads)`` job through ``train_run.run``, to the first failure."""
    out = []
    for label, cfg, threads in jobs:
        torch.set_num_threads(threads)
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS afresh (Linux): the run's peak is its own, not an earlier run's
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                summary = run(cfg, env=env)
        except Exception as exc:  # one plan failing (e.g. a diverging loss) must not hide the others'
            return out + [(label, {"error": str(exc).strip() or type(exc).__name__})]
        out.append((label, {**summary["metrics"], "run": str(cfg.out)}))
    return out


def validate(advice: Advice, repeats: int = 3, steps: int = 8, out: str | Path = Path("runs") / "advise",
             progress: bool = True, record: Callable[[str, dict], None] = lambda label, metrics: None) -> dict:
    """``repeats`` runs of ``steps`` steps of each feasible plan: its command parsed and run as ``labkit train`` does,
    on ``run_ranks`` ranks at its profile's threads; the rounds rotate plans and process counts, so a shared machine's
    slow spell falls on several plans and both counts; ``record(label, metrics)`` after each run. Fills and returns
    ``advice.measured``: a failed plan's ``{"error", "run"}``, else ``steps_s`` (each run's ``batch / samples per
    second``), ``step_s`` their median, ``spread = (max − min) / median``, ``samples_per_s``, ``peak_bytes``,
    ``ratio`` = measured / predicted (``memory_ratio`` alike), ``final_train_loss`` and ``run``."""
    chosen = [e for e in advice.table if e.feasible]
    runs = {e.plan.label: [] for e in chosen if "error" not in advice.measured.get(e.plan.label, {})}
    bar = tqdm(total=len(chosen) * repeats, desc="validating plans", leave=False,
               disable=not progress or not interactive())  # a notebook keeps plain text, not a half-drawn bar
    counts = sorted({e.plan.processes for e in chosen})
    for r in range(max(1, repeats) if chosen else 0):  # round r: r plans further on, the other count first
        turn = chosen[r % len(chosen):] + chosen[:r % len(chosen)]
        for count in counts[r % len(counts):] + counts[:r % len(counts)]:
            jobs = []
            for est in (e for e in turn if e.plan.processes == count and e.plan.label in runs):
                argv = [*est.plan.train_args(advice.model, advice.dataset)[1:], *advice.train_args, "--max-steps",
                        str(steps), "--out", str(Path(out) / f"plan{chosen.index(est)}-{est.plan.strategy}-{r}"),
                        "--epochs", "1", "--test-size", "64", "--device", advice.topology.device, "--log-every", "1000"]
                jobs.append((est.plan.label, config_from_argv(argv), est.threads or advice.topology.threads(count)))
            while jobs:  # after a failed run, the ranks start again for the other plans' runs after it
                try:
                    done = run_ranks(train_runs, count, jobs, timeout=600)[0]
                except (RuntimeError, TimeoutError) as exc:  # a rank died or hung: the first plan gets the line
                    done = [(jobs[0][0], {"error": str(exc).strip() or type(exc).__name__})]
                for label, row in done:
                    bar.update()
                    if "error" in row:  # the message's last line
                        line = f"labkit: error: {row['error'].splitlines()[-1]}"[:300]
                        advice.measured[label] = {"error": line, "run": str(Path(out))}
                        del runs[label]
                    else:
                        runs[label].append(row)
                        record(label, row)
                jobs = jobs[len(done):]  # the failed plan's run was the last done
    bar.close()
    for est, done in ((e, runs[e.plan.label]) for e in chosen if runs.get(e.plan.label)):
        steps_s = [est.plan.batch_size / m["samples_per_sec"] for m in done]
        step = statistics.median(steps_s)
        peak = max(m["peak_memory_gb"] for m in done) * GB
        advice.measured[est.plan.label] = dict(
            step_s=step, steps_s=steps_s, spread=(max(steps_s) - min(steps_s)) / step,
            samples_per_s=est.plan.batch_size / step, peak_bytes=peak, ratio=step / est.step_s,
            memory_ratio=peak / est.peak_bytes, final_train_loss=done[-1]["final_train_loss"], run=done[-1]["run"])
    return advice.measured

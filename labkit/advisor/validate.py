"""Validate: run the top plans for real through ``labkit train`` (torchrun underneath) and record measured
step time and memory beside the prediction.

The measured step is ``global batch / samples per second`` of the training loop's own meter (it skips the
first step: allocation and schedule set-up are not throughput); the measured memory is the run's
``peak_memory_gb`` (on CPU the largest process peak RSS, which the prediction's ``runtime`` term covers).
"""
from __future__ import annotations

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


def validate(advice: Advice, top: int = 3, steps: int = 8, out: str | Path = Path("runs") / "advise",
             echo: Callable[[str], None] | None = None, progress: bool = True,
             extra: tuple[str, ...] = (), relevel: bool = True,
             processes: int | None = None) -> dict[str, dict]:
    """Run the first ``top`` feasible plans of ``advice.table``; fill and return ``advice.measured``.

    ``processes``: only plans that run on this many processes (e.g. the ranks the profile was re-timed for).

    ``extra`` are more ``labkit train`` arguments (e.g. ``("--base-lr", "0.005")`` for AlexNet). A plan whose
    run fails gets ``{"error": last line, "run"}`` instead of numbers. ``relevel``: right after each run,
    time the loop's step again (:func:`labkit.advisor.profile.relevel`) and price the plan with it too: on a
    shared machine the load a minute earlier, when the profile was taken, may not be the run's.

    Returns:
        ``{plan label: {"step_s", "samples_per_s", "peak_bytes", "ratio" (measured / predicted step),
        "final_train_loss", "run"[, "predicted_at_run_s", "ratio_at_run"]}}``.
    """
    from labkit.advisor.pricing import price
    from labkit.advisor.profile import relevel as relevel_profile
    from labkit.launch import RunFailed, torchrun

    chosen = [e for e in advice.table if e.feasible and processes in (None, e.plan.processes)][:top]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chosen), desc="validating plans", leave=False)
    for i, est in enumerate(chosen):
        run_dir = Path(out) / f"plan{i}-{est.plan.strategy}"
        try:
            run = torchrun([*run_args(advice, est.plan.label, run_dir, steps), *extra], nproc=est.plan.processes,
                           echo=echo)
        except RunFailed as exc:  # one plan failing (e.g. a diverging loss) must not hide the others' numbers
            lines = str(exc).splitlines()
            why = next((line for line in lines if line.startswith("labkit: error: ")), lines[-1])
            advice.measured[est.plan.label] = {"error": why[:300], "run": str(run_dir)}
            continue
        finally:
            if bar is not None:
                bar.update()
        metrics = run.summary["metrics"]
        rate = metrics["samples_per_sec"]
        step = est.plan.batch_size / rate
        advice.measured[est.plan.label] = {
            "step_s": step, "samples_per_s": rate, "peak_bytes": metrics["peak_memory_gb"] * GB,
            "ratio": step / est.step_s, "memory_ratio": metrics["peak_memory_gb"] * GB / est.peak_bytes,
            "final_train_loss": metrics["final_train_loss"], "run": str(run_dir)}
        prof = advice.profiles.get(advice.topology.threads(est.plan.processes)) if relevel else None
        if prof is not None:  # priced again with the machine's speed right after the run
            now = price(est.plan, relevel_profile(prof), advice.topology).step_s
            advice.measured[est.plan.label].update(predicted_at_run_s=now, ratio_at_run=step / now)
    if bar is not None:
        bar.close()
    return advice.measured

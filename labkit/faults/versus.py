"""The failures no single run shows, measured against the fixed version (``labkit faults run`` prints these).

* lr-not-scaled: the loss over the last epoch, broken against fixed, with the learning rate each used.
* unsynced-timing: on a GPU, the throughput the program reports against the same program with
  ``CUDA_LAUNCH_BLOCKING=1`` (every kernel finishes before its launch returns, so the clock is right); on a
  CPU every operation finishes before it returns, so both agree and the note says so.
"""
from __future__ import annotations

from labkit.faults.runner import Outcome, run_fault


def last_epoch_loss(outcome: Outcome, steps: int) -> float:
    losses = outcome.ranks[0]["losses"][-steps:]
    return sum(losses) / len(losses)


def versus(name: str, outcome: Outcome, fixed: Outcome | None = None, **kwargs) -> list[str]:
    """The lines above for ``outcome`` of fault ``name``; ``fixed``: a run of the fixed version already made
    (lr-not-scaled), else it runs with ``kwargs`` (those of :func:`labkit.faults.runner.run_fault`)."""
    if outcome.status != "finished":
        return []
    if name == "lr-not-scaled":
        fixed = fixed or run_fault(name, fixed=True, **kwargs)
        steps = len(outcome.ranks[0]["record"]["orders"][-1]) // 32 if outcome.ranks[0]["record"]["orders"] else 8
        mine, right = last_epoch_loss(outcome, steps), last_epoch_loss(fixed, steps)
        lr, scaled = outcome.ranks[0]["record"]["lr"], fixed.ranks[0]["record"]["lr"]
        verdict = "slower" if mine > right else "not slower"
        return [f"mean loss over the last epoch {mine:.3f} at lr {lr:g}, against {right:.3f} at lr {scaled:g} "
                f"(scaled by the {len(outcome.ranks)} ranks): {verdict} convergence"]
    if name == "unsynced-timing":
        env = dict(kwargs.pop("env", None) or {})
        if env.get("DEVICE") != "cuda":
            return ["on a CPU each operation finishes before it returns, so the unsynchronised clock is right here; "
                    "run with --device cuda on a GPU node to see the too-good throughput"]
        blocking = run_fault(name, env={**env, "CUDA_LAUNCH_BLOCKING": "1"}, **kwargs)
        said, real = outcome.ranks[0]["extras"]["samples_per_s"], blocking.ranks[0]["extras"]["samples_per_s"]
        return [f"the program reports {said:.0f} samples/s; with every kernel waited for (CUDA_LAUNCH_BLOCKING=1) "
                f"{real:.0f} samples/s: {said / real:.1f}x too good"]
    return []

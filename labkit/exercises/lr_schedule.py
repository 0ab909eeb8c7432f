"""Notebook 06's exercise (``labkit check lr-schedule FILE``): linear scaling and warm-up for N GPUs.

``lr_at(step, base_lr, world_size, steps_per_epoch, warmup_epochs)`` is the learning rate at optimizer step
``step`` (from 0) of a data-parallel run on ``world_size`` ranks (Goyal et al. 2017):

* linear scaling: the global batch is ``world_size`` times larger, so the target rate is
  ``base_lr × world_size``;
* warm-up: over the first ``warmup_epochs`` (``warmup_epochs × steps_per_epoch`` steps) the rate rises
  linearly from ``base_lr`` (one rank's rate) to the target, then stays there.

The checker compares with the schedule ``labkit train --scale-lr --warmup-epochs E`` runs.
"""
from __future__ import annotations

from typing import Callable

from labkit.exercises import command

STARTER = '''\
def lr_at(step, base_lr, world_size, steps_per_epoch, warmup_epochs):
    """Learning rate at optimizer step `step` (from 0) with linear scaling and linear warm-up."""
    target = base_lr  # TODO: linear scaling rule
    # TODO: during the first warmup_epochs, rise linearly from base_lr to target
    return target
'''

CASES = [  # (base_lr, world_size, steps_per_epoch, warmup_epochs)
    (0.1, 8, 10, 2), (0.05, 4, 7, 1.5), (0.2, 3, 5, 1), (0.1, 16, 3, 0), (0.01, 2, 4, 3)]


def expected(step: int, base_lr: float, world_size: int, steps_per_epoch: int, warmup_epochs: float) -> float:
    """What ``labkit train --scale-lr --warmup-epochs`` sets at ``step`` on ``world_size`` >= 2 ranks."""
    from labkit.train.loop import lr_factor

    return base_lr * world_size * lr_factor(step, steps_per_epoch, [], 1.0, warmup_epochs, 1 / world_size)


def check(lr_at: Callable) -> list[str]:
    """Problems of ``lr_at`` over several runs' first epochs; [] when it matches everywhere."""
    for base_lr, p, spe, warm in CASES:
        for step in range(int(spe * (warm + 2))):
            want = expected(step, base_lr, p, spe, warm)
            try:
                got = float(lr_at(step, base_lr, p, spe, warm))
            except Exception as exc:  # the learner's code: say what it raised, do not crash
                return [f"lr_at raised {type(exc).__name__}: {exc}"]
            if abs(got - want) > 1e-9 * max(1.0, want):
                return [_diagnose(got, want, step, base_lr, p, spe, warm)]
    return []


def _diagnose(got: float, want: float, step: int, base_lr: float, p: int, spe: int, warm: float) -> str:
    where = (f"lr_at(step={step}, base_lr={base_lr}, world_size={p}, steps_per_epoch={spe}, "
             f"warmup_epochs={warm}) = {got:.6g}, expected {want:.6g}")
    if step >= warm * spe and abs(got - base_lr) < 1e-12:
        return where + ": after warm-up the rate is base_lr × world_size (linear scaling)"
    if step < warm * spe and abs(got - base_lr * p) < 1e-12:
        return where + ": during warm-up the rate starts at base_lr and rises linearly to base_lr × world_size"
    if step == 0:
        return where + ": the first step uses base_lr, one rank's rate"
    return where + ": rise linearly in the step: base_lr + (target - base_lr) × step / (warmup_epochs × steps_per_epoch)"


def reference(step, base_lr, world_size, steps_per_epoch, warmup_epochs):
    """The solution, written from the rule."""
    target = base_lr * world_size
    warmup_steps = warmup_epochs * steps_per_epoch
    if step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * step / warmup_steps


def main(argv: list[str]) -> int:
    return command("lr-schedule", __doc__, "lr_at", check,
                   "lr_at equals the schedule of labkit train --scale-lr --warmup-epochs", argv)

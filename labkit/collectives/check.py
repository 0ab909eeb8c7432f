"""Checker for the ring exercise of notebook 01 (``labkit check allreduce [FILE.py[:FUNCTION]]``).

The learner writes ``ring_schedule(p)`` returning a list of steps; each step is a list of
``(src, dst, chunk, op)`` tuples with ``op`` ``"reduce"`` (the receiver adds) or ``"copy"`` (it stores).
The checker replays it for several world sizes and says precisely what is wrong: a broken ring rule
(sending to a non-neighbour, a rank idle in a step, the wrong number of steps), data added twice, or a
rank that ends without the full sum.

    labkit check allreduce my_ring.py                 # file defining ring_schedule(p)
    labkit check allreduce my_ring.py:my_function
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable

import torch

from labkit.collectives.algorithms import ring
from labkit.collectives.schedule import Schedule, ScheduleError, from_steps
from labkit.collectives.simulate import simulate
from labkit.errors import ConfigError


STARTER = '''\
def ring_schedule(p):
    """2(p-1) steps; each a list of (src, dst, chunk, op) with op "reduce" (receiver adds) or "copy"."""
    steps = []
    # share-reduce: p - 1 steps, the receiver adds
    for s in range(p - 1):
        steps.append([(r, (r + 1) % p, r, "reduce") for r in range(p)])   # TODO: which chunk in step s?
    # share-only: p - 1 steps, the receiver stores
    # TODO: append the share-only steps
    return steps
'''


def reference_ring(p: int) -> list[list[tuple[int, int, int, str]]]:
    """The library's ring schedule in the exercise format (the solution)."""
    return [[(t.src, t.dst, t.start, t.op.value) for t in step.transfers] for step in ring(p).steps]


@dataclass
class CheckReport:
    """Per world size: ``None`` if right, else the list of problems found."""

    results: dict[int, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.results) and not any(self.results.values())

    def __str__(self) -> str:
        head = "ring schedule: " + ", ".join(f"p={p} {'ok' if not probs else 'WRONG'}"
                                             for p, probs in self.results.items())
        lines = [head]
        for p, probs in self.results.items():
            lines += [f"  p={p}: {msg}" for msg in probs]
        if self.ok:
            lines.append("  all world sizes reduce correctly with 2(p-1) neighbour-only steps. Well done!")
        return "\n".join(lines)


def _ring_rules(schedule: Schedule) -> list[str]:
    p, problems = schedule.world_size, []
    if schedule.num_steps != 2 * (p - 1):
        problems.append(f"expected 2(p-1) = {2 * (p - 1)} steps ({p - 1} share-reduce + {p - 1} share-only), "
                        f"got {schedule.num_steps}")
    for i, step in enumerate(schedule.steps, 1):
        for t in step.transfers:
            if t.dst != (t.src + 1) % p:
                problems.append(f"step {i}: rank {t.src} sends to rank {t.dst}, but in a ring rank {t.src} may "
                                f"only send to its neighbour rank {(t.src + 1) % p}")
        senders = [t.src for t in step.transfers]
        idle = sorted(set(range(p)) - set(senders))
        if idle:
            problems.append(f"step {i}: rank(s) {', '.join(map(str, idle))} send nothing; in the ring every "
                            "rank sends one chunk per step")
    return problems


def check_schedule(steps, p: int) -> list[str]:
    """Problems of one learner schedule (the output of ``ring_schedule(p)``) for world size ``p``."""
    if isinstance(steps, Schedule):
        schedule = steps
    else:
        try:
            schedule = from_steps("ring-exercise", p, p, steps)
        except (TypeError, ValueError) as exc:
            return [f"cannot read the returned steps: {exc} (expected a list of steps, each a list of "
                    "(src, dst, chunk, op) tuples)"]
    try:
        schedule.validate()
    except ScheduleError as exc:
        return [str(exc)]
    problems = _ring_rules(schedule)
    inputs = [torch.arange(3 * p + 1, dtype=torch.float64) * (r + 1) + 1000 * r for r in range(p)]
    try:
        simulate(schedule, inputs)
    except ScheduleError as exc:
        problems.append(str(exc))
    return problems


def check_ring(fn: Callable[[int], object], world_sizes=(2, 3, 4, 5)) -> CheckReport:
    """Replay ``fn(p)`` for each world size; never raises for a wrong answer (the report says what is wrong)."""
    report = CheckReport()
    for p in world_sizes:
        try:
            steps = fn(p)
        except Exception as exc:  # the learner's code: report it, do not crash the notebook
            report.results[p] = [f"ring_schedule({p}) raised {type(exc).__name__}: {exc}"]
            continue
        report.results[p] = check_schedule(steps, p)
    return report


def load_function(spec: str) -> Callable:
    """``"file.py"`` or ``"file.py:function"`` (default function ``ring_schedule``) -> the function."""
    from labkit.exercises import load_function as load

    return load(spec, "ring_schedule")

def main(argv: list[str]) -> int:
    """Entry point of ``labkit check allreduce``; exit code 0 when the schedule is right, 1 otherwise."""
    from labkit.cli import Parser

    parser = Parser(prog="labkit check allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", help="FILE.py[:FUNCTION] defining ring_schedule(p); "
                        "without it the reference solution is checked")
    parser.add_argument("--ranks", default="2,3,4,5", help="world sizes to try (default 2,3,4,5)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.ranks.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2 or max(sizes) > 64:
        raise ConfigError(f"--ranks {args.ranks!r}: give world sizes >= 2 and <= 64, e.g. 2,3,4,5")
    if args.file is None:
        print("no file given: checking the reference solution (labkit.collectives.check.reference_ring)")
    fn = load_function(args.file) if args.file else reference_ring
    report = check_ring(fn, sizes)
    print(report)
    return 0 if report.ok else 1

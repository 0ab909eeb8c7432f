"""Checker for the ring exercise of notebook 01 (``labkit check allreduce [FILE.py[:FUNCTION]]``).

The learner writes ``ring_schedule(p)`` returning a list of steps; each step is a list of
``(src, dst, chunk, op)`` tuples with ``op`` ``"reduce"`` (the receiver adds) or ``"copy"`` (it stores).
The checker replays it for several world sizes and says precisely what is wrong: a broken ring rule
(sending to a non-neighbour, a rank idle in a step, the wrong number of steps in a phase), the first step in
which a rank sends another chunk than the one it received in the step before (the off-by-one chunk index of
share-reduce or share-only), data added twice, or a rank that ends without the full sum.

    labkit check allreduce my_ring.py                 # file defining ring_schedule(p)
    labkit check allreduce my_ring.py:my_function
"""
from __future__ import annotations

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


def _phase(step) -> str:
    ops = {t.op.value for t in step.transfers}
    return "share-reduce" if ops == {"reduce"} else "share-only" if ops == {"copy"} else "mixed"


def _step_count(schedule: Schedule) -> list[str]:
    """The wrong number of steps, said per phase: which phase has too many or too few."""
    p, phases = schedule.world_size, [_phase(step) for step in schedule.steps]
    reduce, copy = phases.count("share-reduce"), phases.count("share-only")
    problems = []
    if schedule.num_steps != 2 * (p - 1):
        problems.append(f"expected 2(p-1) = {2 * (p - 1)} steps ({p - 1} share-reduce + {p - 1} share-only), got "
                        f"{schedule.num_steps} ({reduce} share-reduce + {copy} share-only"
                        + (f" + {phases.count('mixed')} mixing both ops" if "mixed" in phases else "") + ")")
        for phase, got in (("share-reduce", reduce), ("share-only", copy)):
            if got != p - 1:
                miss = abs(got - (p - 1))
                problems.append(f"the {phase} phase has {got} step(s), {'one' if miss == 1 else miss} "
                                f"{'too many' if got > p - 1 else 'too few'}: it takes p-1 = {p - 1} steps, so "
                                f"that each of the p chunks travels past the other p-1 ranks "
                                "(`for s in range(p - 1)`)")
    if reduce and copy and phases.index("share-only") < len(phases) - 1 - phases[::-1].index("share-reduce"):
        problems.append("a share-reduce step comes after a share-only step: first all p-1 share-reduce steps "
                        "(every chunk summed on one rank), then the p-1 share-only steps")
    return problems


def _forwarding(schedule: Schedule) -> str | None:
    """The first step in which a rank does not pass on the chunk it received in the step before (the ring's
    rule in both phases: in the first share-only step that is the chunk it has just finished summing)."""
    p, received = schedule.world_size, None
    for i, step in enumerate(schedule.steps, 1):
        sends = {t.src: t.start for t in step.transfers if t.stop - t.start == 1 and t.dst == (t.src + 1) % p}
        if received is not None:
            wrong = {r: (c, received[r]) for r, c in sorted(sends.items()) if r in received and c != received[r]}
            if wrong:
                offsets = {(c - want) % p for c, want in wrong.values()}
                r, (c, want) = next(iter(wrong.items()))
                phase = _phase(step)
                k = [j for j, s in enumerate(schedule.steps[:i], 1) if _phase(s) == phase].index(i) + 1
                off = ""
                if offsets in ({1}, {p - 1}):
                    off = f" (off by one: the chunk {'after' if offsets == {1} else 'before'} the one that arrived)"
                return (f"step {i} ({phase} step {k}): rank {r} sends chunk {c}, but it must pass on chunk {want}, "
                        f"the chunk it received in step {i - 1}{off}; in every step after the first, each rank "
                        "forwards the chunk that arrived in the step before"
                        + (f" (as do {len(wrong) - 1} other rank(s) in this step)" if len(wrong) > 1 else ""))
        received = {t.dst: t.start for t in step.transfers if t.stop - t.start == 1}
    return None


def _ring_rules(schedule: Schedule) -> list[str]:
    p = schedule.world_size
    problems = _step_count(schedule)
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
    except ScheduleError as exc:  # name the step and chunk where the ring went wrong before the end state
        forwarding = _forwarding(schedule)
        problems += [forwarding] if forwarding else []
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

    parser = Parser(prog="labkit check allreduce", description=__doc__)
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
        print("no file given: checking the reference solution (labkit.exercises.allreduce.reference_ring)")
    fn = load_function(args.file) if args.file else reference_ring
    report = check_ring(fn, sizes)
    print(report)
    return 0 if report.ok else 1

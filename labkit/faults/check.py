"""``labkit check faults-NAME FILE``: judge a learner's fix of a broken program.

    labkit check faults-uneven-inputs --init my_fix.py    # the broken program, to fix
    labkit check faults-uneven-inputs my_fix.py           # "correct: ..." or "not yet: ..." and exit 1

The fix must finish on the ranks (a hang ends after --watchdog seconds with the table), pass the silent-failure
checks, and train to the same weights as the kit's fixed version.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from labkit.cli import HelpFormatter
from labkit.errors import ConfigError
from labkit.exercises import parse_file, report
from labkit.faults import FAULTS, broken_source, get
from labkit.faults.runner import run_fault, run_program


def _weights(outcome) -> torch.Tensor:
    return torch.cat([v.flatten().float() for v in outcome.state(0).values()])


@functools.lru_cache(maxsize=None)
def reference(name: str, ranks: int):
    """The fixed version's run (kept: a learner checks the same exercise again and again)."""
    outcome = run_fault(name, fixed=True, ranks=ranks)
    if outcome.status != "finished":
        raise RuntimeError(f"the fixed version of {name} did not finish: {outcome.table or outcome.error}")
    return outcome


def check_file(name: str, path: str | Path, ranks: int = 2, watchdog: float = 5.0) -> list[str]:
    """The problems of the fix in ``path`` for fault ``name``; [] when it is right."""
    fault = get(name)
    mine = run_program(path, ranks, watchdog, fault.launcher, lost=fault.lost)
    if mine.status == "hung":
        return [f"it still hangs:\n{mine.table}"]
    if mine.status == "failed":
        return [*_left_alone(mine, fault), "it failed: " + "\n  ".join(mine.failure_report())]
    problems = list(mine.findings)
    if name == "unsynced-timing" and "synchronize(" not in Path(path).read_text():
        problems.append("the clock is read without torch.cuda.synchronize(): on a GPU the kernels are still queued "
                        "(a CPU cannot show it, so this check reads the file)")
    right = reference(name, ranks)
    diff = (_weights(mine) - _weights(right)).abs().max().item()
    if not diff <= 1e-5:
        problems.append(f"it trains to other weights than the fixed version (up to {diff:.3g} apart), which "
                        f"changes only this: {fault.remedy}")
    return problems


PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


def _left_alone(outcome, fault) -> list[str]:
    """The mistake behind a transport error on a rank whose peers finished: it was still in a collective when they
    ended their program and closed their connections, so the ranks ran different numbers of collectives."""
    first = outcome.failures[0] if outcome.failures else None
    finished = sorted(r["rank"] for r in outcome.ranks)
    if first is None or not finished or not any(text in first["message"] for text in PEER_GONE):
        return []
    others = ", ".join(map(str, finished))
    return [f"rank {first['rank']} was still waiting in a collective when rank(s) {others} had finished and closed "
            "their connections: the ranks ran different numbers of collectives (a barrier at the end only made the "
            "others wait for it; without one they leave, and its collective fails). The fix makes the counts "
            f"equal: {fault.remedy}"]


def main(name: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"labkit check faults-{name}", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("file", help="your fixed copy of the program (FILE.py, or FILE.py:main)")
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--watchdog", type=float, default=5.0,
                        help="seconds in one collective that count as a hang (default 5)")
    args = parser.parse_args(argv)
    from labkit.faults.cli import validate

    validate(name, args.ranks, "cpu")
    if not args.watchdog > 0:
        raise ConfigError(f"--watchdog must be a positive number of seconds, got {args.watchdog}")
    path = Path(args.file.split(":")[0])
    if not path.is_file():
        raise ConfigError(f"no such file {str(path)!r}; start from the broken program: "
                          f"labkit check faults-{name} --init {path}")
    parse_file(path)  # one line with the file and the line, before any rank starts
    problems = check_file(name, path, args.ranks, args.watchdog)
    print(report(problems, f"{path} finishes on {args.ranks} ranks and trains to the fixed version's weights"))
    return 0 if not problems else 1


def __getattr__(attr: str):
    """``check_<fault>`` (a checker) and ``starter_<fault>`` (its starting file) for every fault."""
    kind, _, fault = attr.partition("_")
    name = fault.replace("_", "-")
    if name in FAULTS and kind == "check":
        return functools.partial(main, name)
    if name in FAULTS and kind == "starter":
        return broken_source(name)
    raise AttributeError(attr)

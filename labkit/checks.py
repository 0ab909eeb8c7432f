"""``labkit check NAME [ARGS]``: checkers that tell a learner whether an exercise is right, and what is wrong."""
from __future__ import annotations

import argparse
import importlib

from labkit.errors import ConfigError

#: exercise name -> "module:function" taking argv (list of str) and returning an exit code
CHECKS: dict[str, str] = {
    "allreduce": "labkit.collectives.check:main",
    "gpipe-exercise": "labkit.strategies.gpipe_check:main",
    "column-parallel": "labkit.strategies.tensor_parallel_check:main",
}


def run_check(name: str, argv: list[str] | None = None) -> int:
    if name not in CHECKS:
        raise ConfigError(f"unknown check {name!r}; choose one of: {', '.join(CHECKS)}")
    module, _, func = CHECKS[name].partition(":")
    return int(getattr(importlib.import_module(module), func)(list(argv or [])) or 0)


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check a workshop exercise", description=__doc__)
    p.add_argument("name", help=f"one of: {', '.join(CHECKS)}")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the checker (e.g. a FILE)")
    p.set_defaults(func=lambda a: run_check(a.name, a.args))

"""The ``labkit`` command. Each sub-command lives in its own module, imported only when used::

    labkit train --model lenet --dataset mnist-sample --epochs 2
    labkit tour
    labkit data fetch mnist cifar10
    labkit allreduce verify --ranks 4 --algo all
    labkit bench single
    labkit check allreduce
    labkit advise --model lenet --ranks 2
"""
from __future__ import annotations

import argparse
import importlib
import sys

from labkit.errors import LabkitError

#: command name -> module that defines ``add_parser(subparsers)``
COMMANDS: dict[str, str] = {
    "tour": "labkit.tour",
    "train": "labkit.train_cli",
    "data": "labkit.data",
    "allreduce": "labkit.collectives.cli",
    "bench": "labkit.bench",
    "check": "labkit.checks",
    "advise": "labkit.advisor.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description="A hands-on kit for distributed deep learning.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a sub-command; a :class:`LabkitError` becomes one ``labkit: error: ...`` line and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except LabkitError as exc:
        print(f"labkit: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("labkit: interrupted", file=sys.stderr)
        return 130

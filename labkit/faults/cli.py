"""``labkit faults``: broken distributed programs to run, diagnose and fix.

    labkit faults list                                  # the programs and what goes wrong in each
    labkit faults run mismatched-collective             # run on 2 local gloo ranks under the watchdog
    labkit faults run uneven-inputs --ranks 4 --watchdog 5
    labkit faults run nan-spreads --fixed               # the fixed version, for comparison
    labkit check faults-uneven-inputs --init my_fix.py  # the program to fix; then: labkit check faults-... my_fix.py

A run that hangs ends, after --watchdog seconds in one collective, with a table of where every rank is; a
run that finishes is checked for the silent failures (replicas that differ, repeated sample orders, a NaN's
first rank, two ranks on one GPU). Exit code 0 when the run finished and looks right, 1 otherwise.
"""
from __future__ import annotations

import argparse

from labkit.errors import ConfigError, DeviceError, flag_error
from labkit.faults import FAULTS, get
from labkit.ranges import within

MAX_RANKS = 8


class _Parser(argparse.ArgumentParser):
    """A bad flag is one ``labkit: error: ...`` line and exit code 2, like labkit's other errors."""

    def error(self, message: str):
        flag_error(message, f" (see {self.prog} --help)")


def validate(name: str, ranks: int, device: str) -> None:
    """Refuse a bad combination before any rank starts."""
    fault = get(name)
    least = 1 if device == "cuda" else 2  # one GPU is enough to see unsynchronised timing
    if not least <= ranks <= MAX_RANKS:
        raise ConfigError(f"--ranks must be between {least} and {MAX_RANKS} (local ranks), got {ranks}")
    if fault.even_ranks and ranks % 2:
        raise ConfigError(f"{name} pairs the ranks (rank XOR 1); --ranks must be even, got {ranks}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda")
    if device == "cuda":
        if name != "unsynced-timing":
            raise ConfigError(f"--device cuda is for unsynced-timing; {name} runs on CPU gloo ranks")
        import torch

        if torch.cuda.device_count() < ranks:
            raise DeviceError(f"--device cuda needs a GPU per rank (NCCL): {ranks} ranks, "
                              f"{torch.cuda.device_count()} GPU(s) here; lower --ranks or use --device cpu")


def run(args: argparse.Namespace) -> int:
    from labkit.faults.runner import run_fault
    from labkit.faults.versus import versus

    validate(args.name, args.ranks, args.device)
    fault = FAULTS[args.name]
    print(f"{args.name}{' (fixed)' if args.fixed else ''} on {args.ranks} ranks, watchdog {args.watchdog:g} s: "
          f"{fault.summary}", flush=True)
    env = {"DEVICE": args.device}
    outcome = run_fault(args.name, fixed=args.fixed, ranks=args.ranks, watchdog=args.watchdog, env=env, echo=print)
    if outcome.status == "hung":
        print(outcome.table)
    elif outcome.status == "failed":
        first, *after = outcome.failure_report()
        print(f"labkit: {first}\n{outcome.error.rstrip()}")
        for line in after:
            print(f"labkit: {line}")
    for line in outcome.findings:
        print(f"labkit: found: {line}")
    notes = versus(args.name, outcome, ranks=args.ranks, watchdog=args.watchdog, env=env)
    for line in notes:
        print(f"labkit: measured: {line}")
    clean = outcome.status == "finished" and not outcome.findings and not any("slower" in n for n in notes)
    if clean:
        print("labkit: the run finished and the checks found nothing wrong")
    return 0 if clean else 1


def list_faults(args: argparse.Namespace) -> int:
    width = max(map(len, FAULTS))
    for i, (name, fault) in enumerate(FAULTS.items(), 1):
        print(f"{i:2d}. {name:<{width}}  {fault.summary}\n    {'':<{width}}  {fault.symptom}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("faults", help="broken distributed programs to run, diagnose and fix", description=__doc__)
    p.__class__ = _Parser
    inner = p.add_subparsers(dest="faults_command", metavar="COMMAND", required=True, parser_class=_Parser)
    inner.add_parser("list", help="the broken programs").set_defaults(func=list_faults)
    r = inner.add_parser("run", help="run one under the watchdog and diagnose it")
    r.add_argument("name", choices=list(FAULTS), metavar="NAME", help="one of: " + ", ".join(FAULTS))
    r.add_argument("--ranks", type=within("int", f"[1, {MAX_RANKS}]"), default=2, help="local gloo ranks (default 2)")
    r.add_argument("--watchdog", type=within("float", "(0, 1e7]"), default=10.0, metavar="SECONDS",
                   help="a rank waiting this long in one collective ends the run with the table (default 10)")
    r.add_argument("--device", default="cpu", help="cpu, or cuda for unsynced-timing on a GPU (default cpu)")
    r.add_argument("--fixed", action="store_true", help="run the fixed version instead")
    r.set_defaults(func=run)

"""Run any PyTorch script as one rank, with the hang watchdog (and, if asked, the collective check) started first.

    srun python -m labkit doctor --watchdog 60 [--check-collectives] train.py ARGS     # each SLURM task
    python -m labkit.dist.torchrun --watchdog 60 [--check-collectives] --nproc-per-node 2 train.py ARGS

The script needs no change and no labkit import: this command starts the watchdog
(:mod:`labkit.faults.watchdog`) in the rank, wraps torch.distributed's collectives when
``--check-collectives`` is given (:mod:`labkit.faults.consistency`), and then runs the script (or, with ``-m``,
the module) as Python would: ``__name__ == "__main__"``, ``sys.argv`` = the script and its arguments, its
folder first on ``sys.path``. The torchrun wrapper above starts every rank this way. A hang ends with the
watchdog's table on rank 0 and exit code 124; with the check, the first collective the ranks disagree on ends
the job with one ``labkit: collective mismatch: ...`` line and exit code 124 too. The check costs a few store
round trips per collective (about a millisecond; docs/ARCHITECTURE.md has the measurement), so it is off by
default; without it nothing is wrapped and a training step gains nothing.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
import traceback

from labkit.dist.torchrun import add_doctor_flags, refuse_missing


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="run any PyTorch script as a rank under the hang watchdog",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_doctor_flags(p)
    p.add_argument("-m", dest="module", action="store_true", help="run a module (python -m NAME) instead of a file")
    p.add_argument("script", metavar="SCRIPT", help="the script (or, with -m, the module) each rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the watchdog (and the check), then run the script; its exit code (1 for an uncaught exception)."""
    refuse_missing(args.script, args.module)
    from labkit.faults.watchdog import ENDING, Watchdog

    seconds = 300.0 if args.watchdog is None else args.watchdog
    if seconds:
        Watchdog(seconds).start()
    if args.check_collectives:
        from labkit.faults.consistency import install

        install()
    sys.argv = [args.script, *args.script_args]
    try:
        if args.module:
            runpy.run_module(args.script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else _say(exc.code))
    except BaseException:  # the script's own error: its traceback, as Python would print it, without this frame
        if ENDING.wait(0.5 if seconds else 0):  # a collective failed as the watchdog ends the job: let it, with 124
            time.sleep(30)
        kind, value, tb = sys.exc_info()
        traceback.print_exception(kind, value, tb.tb_next)
        return 1
    return 0


def _say(message) -> int:
    print(message, file=sys.stderr)
    return 1

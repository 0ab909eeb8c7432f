"""``python -m labkit.dist.torchrun ARGS`` is ``torchrun ARGS``, except that a run the ranks ended with a labkit
message ends with that message alone, and a stop signal to torchrun itself reaches the ranks.

When a rank stops on a configuration error (exit 2, after its one ``labkit: error: ...`` line) or on a stop
signal after checkpointing (exit 75, ``labkit: stopped ...``), plain torchrun adds its own error block
(a ``ChildFailedError`` traceback, a "Root Cause" table and a log line per failed rank) and exits 1. Here
that block is left out and the exit code is the rank's: 2 or 75, what the job scripts act on. Any other
failure (a Python exception in a rank, a killed rank) shows torchrun's block and the rank's traceback as
before.

``--watchdog SECONDS`` and ``--check-collectives`` (before the script) start every rank through ``labkit
doctor`` (:mod:`labkit.faults.doctor`): the hang watchdog, and the collective check, in any script, with no
change to it. They are refused with ``--no-python`` (the ranks would not run Python).

Signals to torchrun itself (``kill``, ``scancel``, SLURM's ``--signal=USR1`` without ``B:``, a site wrapper
that signals every process of the step, Ctrl-C): plain torchrun dies on SIGUSR1 and leaves its ranks
training with no parent, and answers SIGTERM by stopping the ranks under a 30-second deadline. Here
SIGUSR1, SIGTERM and SIGINT are passed on to the ranks as they are, and torchrun waits for them: they
finish their step, write their checkpoint and exit 75, and so does torchrun. A second signal while it waits
stops the ranks at once (torchrun's own shutdown). Ranks that ended any other way (no checkpoint was asked
for, Ctrl-C) end torchrun with one line and exit code 128 + the signal's number, as a shell reports a process
stopped by a signal.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from labkit.errors import ConfigError
from labkit.ranges import within

#: exit codes a rank uses after printing its own labkit line (errors.report; 124: the hang watchdog's table,
#: labkit.faults.watchdog)
LABKIT_EXITS = (2, 75, 124)
EXIT_PREEMPTED = 75  # labkit.train.preempt.EXIT_PREEMPTED (that module imports torch)
#: signals passed on to the ranks; torchrun keeps its own handling of the others (SIGHUP, SIGQUIT)
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_SERVER_LOGGER = "torch.distributed.elastic.agent.server.api"


class _QuietAboutLabkitExits(logging.Filter):
    """Drops the agent's log lines about ranks that left with a labkit exit code: the per-rank "failed
    (exitcode: 2)" line, and the "closing signal" lines sent to the other ranks once a rank reported a
    configuration error (``$LABKIT_ERROR_FILE`` is not empty)."""

    def __init__(self, error_file: str):
        super().__init__()
        self.error_file = error_file

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("failed (exitcode:") and record.args and record.args[0] in LABKIT_EXITS:
            return False
        if message.startswith("Sending process") and "closing signal" in message:
            return not _has_content(self.error_file)
        return True


class _QuietAboutForwardedSignals(logging.Filter):
    """Drops the agent's "Received 10 death signal, shutting down workers" once the ranks it would shut down
    have left by themselves (the signal was passed on to them and they said what they did)."""

    def __init__(self, forwarder: _Forwarder):
        super().__init__()
        self.forwarder = forwarder

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Received %s death signal") and self.forwarder.codes)


def _has_content(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


class _Forwarder:
    """The agent's handler of :data:`FORWARDED`: pass the signal to the ranks, wait until they have left, then
    stop the agent (torchrun's ``SignalException``). ``codes`` are the ranks' exit codes (negative: killed)."""

    def __init__(self):
        self.codes: list[int] = []
        self.waiting = False
        self._previous: dict = {}

    def install(self) -> None:
        """Handle :data:`FORWARDED`. torchrun registers its own ``_terminate_process_handler`` for the signals
        of its ``--signals-to-handle`` (stop the ranks, 30 s, then SIGKILL) as it starts the ranks; that name
        is looked up then, so it finds this handler for :data:`FORWARDED` and torch's for the others."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python allows signal handlers in the main thread only; torchrun's own stay
        from torch.distributed.elastic.multiprocessing import api

        torch_handler = api._terminate_process_handler

        def handler(signum: int, frame) -> None:
            (self if signum in FORWARDED else torch_handler)(signum, frame)
        api._terminate_process_handler = handler
        self._previous = {sig: signal.signal(sig, self) for sig in FORWARDED}
        self._torch = (api, torch_handler)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous:
            api, torch_handler = self._torch
            api._terminate_process_handler = torch_handler
        self._previous = {}

    @staticmethod
    def ranks() -> list:
        """The agent's rank processes: its children started with a ``LOCAL_RANK``."""
        import psutil

        found = []
        for child in psutil.Process().children():
            try:
                if "LOCAL_RANK" in child.environ():
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
            except psutil.AccessDenied:  # cannot tell: a child of torchrun is most likely a rank
                found.append(child)
        return found

    def __call__(self, signum: int, frame) -> None:
        import psutil
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig = signal.Signals(signum)
        ranks = [] if self.waiting else self.ranks()
        for rank in ranks:
            try:
                rank.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        if ranks:  # a second signal arriving here skips this and stops them at once
            self.waiting = True
            gone, _ = psutil.wait_procs(ranks)
            self.codes = [p.returncode for p in gone if p.returncode is not None]
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); return the exit code for the shell."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run

    args = _parse(sys.argv[1:] if argv is None else argv)
    own_file = None
    if not os.environ.get("LABKIT_ERROR_FILE"):  # the ranks append their configuration errors here
        fd, own_file = tempfile.mkstemp(prefix="labkit-errors-")
        os.close(fd)
        os.environ["LABKIT_ERROR_FILE"] = own_file
    logging.getLogger(_AGENT_LOGGER).addFilter(_QuietAboutLabkitExits(os.environ["LABKIT_ERROR_FILE"]))
    forwarder = _Forwarder()
    forwarder.install()
    logging.getLogger(_SERVER_LOGGER).addFilter(_QuietAboutForwardedSignals(forwarder))
    try:
        record(run)(args)
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        if first.exitcode in LABKIT_EXITS:
            return first.exitcode
        raise
    except SignalException as exc:  # torchrun was signalled and its ranks have left
        codes = forwarder.codes
        if codes and EXIT_PREEMPTED in codes and set(codes) <= {0, EXIT_PREEMPTED}:
            return EXIT_PREEMPTED  # the ranks said so themselves: "labkit: stopped ... --resume"
        if codes and set(codes) == {0}:
            return 0  # the signal came as the run finished
        print(f"labkit: torchrun stopped on {signal.Signals(exc.sigval).name}; its ranks were stopped with it",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        forwarder.uninstall()
        if own_file is not None:
            os.unlink(own_file)
    return 0


def add_doctor_flags(p: argparse.ArgumentParser) -> None:
    """``--watchdog`` and ``--check-collectives``: the flags of this wrapper and of ``labkit doctor``."""
    p.add_argument("--watchdog", type=within("float", "[0, 1e7]"), default=None, metavar="SECONDS",
                   help="a rank waiting this long in one collective ends the job with a table of where every rank "
                        "is; 0: off (default 300; in the torchrun wrapper, 300 once either flag is given)")
    p.add_argument("--check-collectives", action="store_true",
                   help="before each collective the ranks compare its operation, group, shape, dtype, reduce op "
                        "and root or peer, and the first disagreement ends the job with one sentence (costs a few "
                        "store round trips per collective)")


def refuse_missing(script: str, module: bool) -> None:
    """A script that is not there is one line, before any rank starts (or before this rank imports torch)."""
    if not module and not os.path.isfile(script):
        raise ConfigError(f"no such script {script!r}; give the path of the Python file each rank runs")


def _parse(argv: list[str]):
    """torchrun's arguments, and ours: with ``--watchdog`` or ``--check-collectives``, each rank runs the script
    through ``python -m labkit doctor``. A bad flag is one ``labkit: error`` line and exit code 2."""
    from torch.distributed.run import get_args_parser

    from labkit.errors import flag_error

    parser = get_args_parser()
    parser.error = lambda message: flag_error(message, " (see torchrun --help)")
    add_doctor_flags(parser)
    args = parser.parse_args(argv)
    if args.watchdog is None and not args.check_collectives:
        return args
    if args.no_python:
        flag_error("--watchdog and --check-collectives run the script in Python; drop --no-python")
    try:
        refuse_missing(args.training_script, args.module)
    except ConfigError as exc:
        flag_error(str(exc))
    inner = ["doctor", *([] if args.watchdog is None else ["--watchdog", f"{args.watchdog:g}"]),
             *(["--check-collectives"] * args.check_collectives),
             *(["-m"] * args.module), args.training_script, *args.training_script_args]
    args.training_script_args = inner
    if args.run_path:  # torchrun runs a file in its own process: labkit's __main__, as a file
        args.training_script = str(Path(__file__).parents[1] / "__main__.py")
    else:
        args.training_script, args.module = "labkit", True
    return args


if __name__ == "__main__":
    sys.exit(main())

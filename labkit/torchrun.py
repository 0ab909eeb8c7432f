"""``python -m labkit.torchrun ARGS`` is ``torchrun ARGS``, except that a run the ranks ended with a labkit
message ends with that message alone.

When a rank stops on a configuration error (exit 2, after its one ``labkit: error: ...`` line) or on a stop
signal after checkpointing (exit 75, ``labkit: stopped ...``), plain torchrun adds its own error block
(a ``ChildFailedError`` traceback, a "Root Cause" table and a log line per failed rank) and exits 1. Here
that block is left out and the exit code is the rank's: 2 or 75, what the job scripts act on. Any other
failure (a Python exception in a rank, a killed rank) shows torchrun's block and the rank's traceback as
before. When torchrun itself is signalled (``scancel``, a time limit, Ctrl-C), it passes the signal on to the
ranks, which write their checkpoint and say so; instead of torchrun's traceback it ends with one line and
exit code 128 + the signal's number, as a shell reports a process stopped by a signal.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile

#: exit codes a rank uses after printing its own labkit line (errors.report; 124: the hang watchdog's table,
#: labkit.faults.watchdog)
LABKIT_EXITS = (2, 75, 124)
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


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


def _has_content(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); return the exit code for the shell."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    own_file = None
    if not os.environ.get("LABKIT_ERROR_FILE"):  # the ranks append their configuration errors here
        fd, own_file = tempfile.mkstemp(prefix="labkit-errors-")
        os.close(fd)
        os.environ["LABKIT_ERROR_FILE"] = own_file
    logging.getLogger(_AGENT_LOGGER).addFilter(_QuietAboutLabkitExits(os.environ["LABKIT_ERROR_FILE"]))
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        if first.exitcode in LABKIT_EXITS:
            return first.exitcode
        raise
    except SignalException as exc:  # torchrun was signalled and has stopped its ranks
        print(f"labkit: torchrun stopped on {signal.Signals(exc.sigval).name}; its ranks were stopped with it",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        if own_file is not None:
            os.unlink(own_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())

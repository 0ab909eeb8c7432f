"""What both launchers (:func:`labkit.launch.local.torchrun`, :func:`labkit.launch.slurm.sbatch`) share: the child's
environment, the tail of a run's log kept for its error message, and the errors they raise.
"""
from __future__ import annotations

import collections
import os
import re
from typing import Mapping

from labkit.errors import ConfigError, LabkitError

TAIL_LINES = 30
_ERROR_LINE = re.compile(r"^(labkit: error: |[\w.]*(Error|Exception)(\[\w+\])?: )")


class RunFailed(LabkitError):
    """A launched run exited with an error; the message ends with the last lines of its log."""


class RanksConfigError(ConfigError, RunFailed):
    """The ranks of a launched run stopped on a configuration error; the message is theirs (printed once)."""


def _child_env(env: Mapping[str, str] | None, threads: int | None) -> dict[str, str]:
    child = dict(os.environ)
    child.update(PYTHONUNBUFFERED="1", LABKIT_PLAIN="1")  # plain lines, no progress bars in a pipe
    if threads is not None and "OMP_NUM_THREADS" not in child:
        child["OMP_NUM_THREADS"] = str(threads)
    child.update({k: str(v) for k, v in (env or {}).items()})
    return child


class _Tail:
    """The last :data:`TAIL_LINES` lines, plus the error lines the ranks printed (the root cause, which a
    launcher's own traceback would push out of the tail)."""

    def __init__(self):
        self.lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.errors: dict[str, None] = {}

    def add(self, line: str) -> None:
        self.lines.append(line)
        if _ERROR_LINE.match(line) and "ChildFailedError" not in line and len(self.errors) < 10:
            self.errors[line] = None

    def text(self) -> str:
        errors = "".join(f"{e}\n" for e in self.errors)
        return (f"errors reported:\n{errors}" if errors else "") + "last lines:\n" + "\n".join(self.lines)

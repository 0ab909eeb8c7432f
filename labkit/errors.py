"""Errors that reach the learner as one clear line (the CLI prints them and exits with code 2)."""
import contextlib
import hashlib
import os
import re
import sys
import tempfile
from typing import NoReturn


class LabkitError(Exception):
    """Base class of every error labkit reports to the user instead of a traceback."""


class ConfigError(LabkitError, ValueError):
    """Bad user input: the message names the bad value and how to fix it."""


class DeviceError(ConfigError):
    """A device or backend was asked for that this machine does not have (e.g. ``--device cuda``)."""


class OutputError(ConfigError):
    """A folder or file labkit must write cannot be created (read-only or missing parent, no permission)."""


class DatasetMissing(LabkitError, FileNotFoundError):
    """The dataset is not on disk and downloading was not requested."""


class DatasetCorrupt(LabkitError):
    """A dataset file is on disk but truncated or fails its checksum."""


class CheckpointError(LabkitError):
    """A checkpoint file is unreadable, corrupt or belongs to a different model."""


def report(exc: LabkitError) -> int:
    """Print ``exc`` as one ``labkit: error: ...`` line and return the exit code (2, or the error's own
    ``exit_code``: a run stopped for pre-emption is no error, it continues later).

    Under torchrun every rank usually hits the same configuration error; the first rank on the node to claim
    the message prints it, the others stay quiet. With ``LABKIT_ERROR_FILE`` set (the job scripts set it) a
    configuration error is also appended there, so the script can exit 2 although torchrun exits 1.
    """
    code = getattr(exc, "exit_code", 2)
    line = f"labkit: {'error: ' if code == 2 else ''}{exc}"
    if code == 2 and os.environ.get("LABKIT_ERROR_FILE"):
        with contextlib.suppress(OSError), open(os.environ["LABKIT_ERROR_FILE"], "a") as f:
            f.write(line + "\n")
    if first_to_say(line):
        print(line, file=sys.stderr, flush=True)
    return code


def flag_error(message: str, hint: str = "") -> NoReturn:
    """What labkit's argparse parsers do with a bad flag: argparse's ``message`` (``argument --epochs: must be
    >= 1, got 0`` reads ``--epochs must be >= 1, got 0``) as one :func:`report` line, then exit code 2."""
    message = re.sub(r"^argument (\S+): must be ", r"\1 must be ", message)
    report(ConfigError(message + hint))
    raise SystemExit(2)


def first_to_say(line: str) -> bool:
    """False when another rank of this torchrun job already printed ``line`` (an O_EXCL file per message)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) < 2:
        return True
    key = hashlib.sha1(f"{run_id}\n{line}".encode()).hexdigest()[:20]
    try:
        os.close(os.open(os.path.join(tempfile.gettempdir(), f"labkit-said-{key}"), os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:  # no usable temp dir: better every rank than none
        return True
    return True

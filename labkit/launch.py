"""Start real multi-process runs from Python or a notebook cell, watch them live, get their results back.

    from labkit.launch import torchrun, sbatch
    run = torchrun(["train", "--strategy", "ddp", "--model", "lenet", "--out", "runs/ddp2"], nproc=2)
    run.summary["metrics"]["samples_per_sec"], run.records_of("epoch")       # ready to plot
    run = sbatch("jobs/job_ddp.sh", env={"NPROC": "4"})                       # on a SLURM login node

Each output line is printed as it arrives (so a notebook cell shows the training as it happens) and kept
in ``<out>/launch.log``. A run that fails raises :class:`RunFailed` with the last lines of its log.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from labkit.errors import ConfigError, LabkitError
from labkit.results import Run, load_run, make_dirs, output_errors

TAIL_LINES = 30
_CONFIG_ERROR = "labkit: error: "
_ERROR_LINE = re.compile(r"^(labkit: error: |[\w.]*(Error|Exception)(\[\w+\])?: )")
#: SLURM job states after which a job never runs again
_DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


class RunFailed(LabkitError):
    """A launched run exited with an error; the message ends with the last lines of its log."""


class RanksConfigError(ConfigError, RunFailed):
    """The ranks of a launched run stopped on a configuration error; the message is theirs (printed once)."""


def _out_dir(args: list[str], prefix: str) -> tuple[list[str], Path]:
    """The ``--out DIR`` of ``args``; if absent, a fresh ``runs/<prefix>-<time>`` appended to ``args``."""
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return args, Path(args[i + 1])
        if arg.startswith("--out="):
            return args, Path(arg.split("=", 1)[1])
    out = Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    return [*args, "--out", str(out)], out


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


def stream(cmd: Sequence[str], env: Mapping[str, str] | None = None, log: Path | None = None,
           timeout: float | None = None, echo: Callable[[str], None] | None = print) -> tuple[int, _Tail]:
    """Run ``cmd``, passing each output line (stdout and stderr) to ``echo`` as it arrives.

    Returns:
        (exit code, the tail of the output).

    Raises:
        RunFailed: still running after ``timeout`` seconds (the whole process group is stopped).
        KeyboardInterrupt: Ctrl-C or the notebook's stop button, after stopping the process group.
    """
    tail = _Tail()
    proc = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)  # own group: stopping it reaches every rank
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        _stop(proc)

    timer = threading.Timer(timeout, expire) if timeout is not None else None
    if timer is not None:
        timer.start()
    try:
        with open(log, "a") if log is not None else contextlib.nullcontext() as log_file:
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.add(line)
                if echo is not None:
                    echo(line)
                if log_file is not None:
                    log_file.write(line + "\n")
                    log_file.flush()
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:  # interrupted: take the ranks down with us
            _stop(proc)
    if expired.is_set():
        raise RunFailed(f"{' '.join(cmd[:6])} ... ran longer than {timeout:.0f} s and was stopped; " + tail.text())
    return rc, tail


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (torchrun forwards it to its workers), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def torchrun(args: Sequence[str], nproc: int = 2, *, env: Mapping[str, str] | None = None,
             max_restarts: int = 0, timeout: float | None = None, module: str = "labkit",
             echo: Callable[[str], None] | None = print) -> Run:
    """Run ``torchrun --standalone --nproc-per-node nproc -m labkit ARGS`` on this machine (through
    :mod:`labkit.torchrun`) and load its results.

    Args:
        args: the ``labkit`` command line, e.g. ``["train", "--strategy", "ddp", "--out", "runs/x"]``;
            without ``--out`` a fresh ``runs/launch-<time>`` is added.
        nproc: processes (ranks) to start: one per GPU, or a few on CPU (gloo).
        env: extra environment variables for the ranks.
        max_restarts: torchrun restarts the whole group this many times after a failure (use with
            ``--resume`` so the restart continues from the last checkpoint).
        timeout: stop the run after this many seconds.
        module: the ``-m`` module to run.
        echo: called with every output line (default ``print``; ``None`` is silent).

    Returns:
        The run read back by :func:`labkit.results.load_run` (``summary``, ``records``).

    Raises:
        RanksConfigError: the ranks stopped on a configuration error (a ConfigError and a RunFailed; its
            message is the ranks' one line).
        RunFailed: any other non-zero exit, or a timeout; the message holds the last lines of the log.
    """
    if nproc < 1:
        raise ConfigError(f"nproc must be >= 1, got {nproc}")
    args, out = _out_dir([str(a) for a in args], "launch")
    make_dirs(out)
    # one thread per core share: torchrun alone would pick 1 thread per rank, or all cores for nproc=1
    threads = max(1, (os.cpu_count() or 1) // nproc)
    # labkit.torchrun: a rank's configuration error ends the run with its one line and exit 2, without
    # torchrun's own error block
    cmd = [sys.executable, "-m", "labkit.torchrun", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), "-m", module, *args]
    child = _child_env(env, threads)
    if max_restarts > 0:
        # torchrun's agent keeps one store for every restart, so a restarted group can read the dead
        # group's addresses (pytorch issue 135712); a fresh store per attempt avoids that
        child.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    log = out / "launch.log"
    with output_errors(log):
        log.write_text("$ " + " ".join(cmd) + "\n")
    rc, tail = stream(cmd, child, log, timeout, echo)
    said = [e[len(_CONFIG_ERROR):] for e in tail.errors if e.startswith(_CONFIG_ERROR)]
    if rc == 2 and said:
        raise RanksConfigError(said[0])
    if rc != 0:
        raise RunFailed(f"torchrun with {nproc} rank(s) exited with code {rc} (log: {log}); " + tail.text())
    return load_run(out)


@dataclass
class Job:
    """A submitted SLURM batch job."""

    job_id: str
    out_dir: Path
    log: Path

    def state(self) -> tuple[str, str]:
        """(JobState, ExitCode) from ``scontrol``, else ``sacct`` once the controller forgot the job."""
        shown = _query(["scontrol", "-o", "show", "job", self.job_id])
        if "JobState=" in shown:
            code = re.search(r"ExitCode=(\S+)", shown)
            return re.search(r"JobState=(\S+)", shown)[1], code[1] if code else ""
        accounted = _query(["sacct", "-j", self.job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])
        line = next((ln for ln in accounted.splitlines() if ln.strip()), "")
        if not line:
            return "UNKNOWN", ""
        state, _, code = line.partition("|")
        return state.split()[0], code.strip()

    def wait(self, poll_s: float = 2.0, timeout: float | None = None,
             echo: Callable[[str], None] | None = print) -> Run:
        """Poll until the job ends, printing new lines of its output file; return its results.

        Interrupting the wait (Ctrl-C, the notebook's stop button) leaves the job running; ``wait()`` again.

        Raises:
            RunFailed: the job ended in any state but COMPLETED (or ``timeout`` passed: it is cancelled).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        tail = _Tail()
        offset, partial, unknown = 0, "", 0
        while True:
            state, code = self.state()
            offset, partial = self._read_new(offset, partial, tail, echo)
            if state in _DONE_STATES:
                break
            unknown = unknown + 1 if state == "UNKNOWN" else 0
            if unknown > 30:
                raise RunFailed(f"SLURM job {self.job_id}: neither scontrol nor sacct knows it any more; "
                                f"see {self.log}")
            if deadline is not None and time.monotonic() > deadline:
                subprocess.run(["scancel", self.job_id], capture_output=True)
                raise RunFailed(f"SLURM job {self.job_id} still {state} after {timeout:.0f} s; cancelled it. "
                                + tail.text())
            time.sleep(poll_s)
        time.sleep(min(poll_s, 1.0))  # the file system may show the last lines a moment later
        self._read_new(offset, partial, tail, echo, final=True)
        if state != "COMPLETED":
            raise RunFailed(f"SLURM job {self.job_id} ended {state} (exit code {code}; log: {self.log}); "
                            + tail.text())
        return load_run(self.out_dir)

    def _read_new(self, offset: int, partial: str, tail, echo, final: bool = False) -> tuple[int, str]:
        """Echo the complete lines written to the output file since byte ``offset`` (all of it if ``final``)."""
        if not self.log.exists():
            return offset, partial
        with open(self.log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        lines = (partial + chunk.decode(errors="replace")).split("\n")
        partial = lines.pop()  # an unfinished last line waits for the next read
        if final and partial:
            lines.append(partial)
        for line in lines:
            tail.add(line)
            if echo is not None:
                echo(line)
        return offset + len(chunk), partial


def _query(cmd: list[str]) -> str:
    """stdout of a SLURM query command, or "" if it failed or is not installed."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return res.stdout if res.returncode == 0 else ""


def sbatch(script: str | Path, *, env: Mapping[str, str] | None = None, args: Sequence[str] = (),
           out: str | Path | None = None, sbatch_args: Sequence[str] = (), wait: bool = True,
           poll_s: float = 2.0, timeout: float | None = None,
           echo: Callable[[str], None] | None = print) -> Run | Job:
    """Submit a job script with ``sbatch``, follow its output, and return its results.

    The script gets ``LABKIT_OUT=<out>`` (labkit job scripts write their results there) and its output
    file is ``<out>/slurm-<jobid>.out``.

    Args:
        script: e.g. ``"jobs/job_ddp.sh"``.
        env: extra environment variables (sizes: ``{"NPROC": "4", "EPOCHS": "10"}``); sbatch passes the
            submitting environment to the job.
        args: arguments after the script name.
        out: results folder (default ``runs/<script name>-<time>``).
        sbatch_args: extra sbatch options, e.g. ``["--nodes=2", "--partition=gpu"]``.
        wait: False returns the :class:`Job` right after submission (call ``job.wait()`` later).
        poll_s: seconds between ``scontrol`` polls.
        timeout: cancel the job after this many seconds of waiting.

    Raises:
        RunFailed: sbatch refused the job, or the job did not complete.
    """
    script = Path(script)
    if not script.exists():
        raise ConfigError(f"job script {script} does not exist; the kit's scripts are in jobs/")
    out = Path(out) if out is not None else Path("runs") / f"{script.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = out.resolve()
    make_dirs(out)  # SLURM opens the output file before the script runs
    child = _child_env(env, None)
    child["LABKIT_OUT"] = str(out)
    cmd = ["sbatch", "--parsable", f"--output={out}/slurm-%j.out", *sbatch_args, str(script), *args]
    try:
        res = subprocess.run(cmd, env=child, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError("sbatch is not installed here: submit from a SLURM login node, or run the job script "
                          f"with plain bash: bash {script}") from None
    if res.returncode != 0:
        raise RunFailed(f"sbatch refused {script} (exit code {res.returncode}): {res.stderr.strip()}")
    job_id = res.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RunFailed(f"sbatch printed no job id for {script}: {res.stdout.strip()!r}")
    job = Job(job_id, out, out / f"slurm-{job_id}.out")
    if echo is not None:
        echo(f"submitted {script} as SLURM job {job_id}; output: {job.log}")
    return job.wait(poll_s, timeout, echo) if wait else job

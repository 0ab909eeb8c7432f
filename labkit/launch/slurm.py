"""Submit a SLURM batch job from Python or a notebook cell, follow its output file, get its results back.

    from labkit.launch.slurm import sbatch# re-exported there
    run = sbatch("jobs/job_ddp.sh", env={"NPROC": "4"})      # on a SLURM login node
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from labkit.errors import ConfigError
from labkit.launch.common import RunFailed, _child_env, _Tail
from labkit.results import Run, load_run, make_dirs

#: SLURM job states after which a job never runs again
_DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


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

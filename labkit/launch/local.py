"""Start real multi-process runs from Python or a notebook cell, watch them live, get their results back.

    from labkit.launch.local import torchrun
    from labkit.launch.slurm import sbatch
    run = torchrun(["train", "--strategy", "ddp", "--model", "lenet", "--out", "runs/ddp2"], nproc=2)
    run.summary["metrics"]["samples_per_sec"], run.records_of("epoch")       # ready to plot
    run = sbatch("jobs/job_ddp.sh", env={"NPROC": "4"})                       # on a SLURM login node

Each output line is printed as it arrives (so a notebook cell shows the training as it happens) and kept
in ``<out>/launch.log``. A run that fails raises :class:`RunFailed` with the last lines of its log.
``sbatch`` and its :class:`Job` live in :mod:`labkit.launch.slurm`, what both share in :mod:`labkit.launch.common`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from labkit.errors import ConfigError
from labkit.launch.common import RanksConfigError, RunFailed, _child_env, _Tail
from labkit.results import Run, load_run, make_dirs, output_errors

_CONFIG_ERROR = "labkit: error: "


def _out_dir(args: list[str], prefix: str) -> tuple[list[str], Path]:
    """The ``--out DIR`` of ``args``; if absent, a fresh ``runs/<prefix>-<time>`` appended to ``args``."""
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return args, Path(args[i + 1])
        if arg.startswith("--out="):
            return args, Path(arg.split("=", 1)[1])
    out = Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    return [*args, "--out", str(out)], out


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
    :mod:`labkit.dist.torchrun`) and load its results.

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
    # labkit.dist.torchrun: a rank's configuration error ends the run with its one line and exit 2, without
    # torchrun's own error block
    cmd = [sys.executable, "-m", "labkit.dist.torchrun", "--standalone", "--nnodes", "1",
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

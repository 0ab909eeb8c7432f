"""Run a fault program (or a learner's fix of it) on local gloo ranks under the watchdog, and diagnose it.

    outcome = run_program("my_fix.py", ranks=2, watchdog=5)
    outcome.status        # "finished", "hung" or "failed"
    outcome.table         # the watchdog's table when it hung
    outcome.findings      # what the silent-failure checks found (labkit.faults.findings)
    outcome.failures      # when it failed: each failed rank's first error with its time, the first one first

A failure on one rank makes its peers fail soon after ("Connection closed by peer": the dead rank's sockets
closed). The rank to read is the one that failed first, not the lowest-numbered one: each rank's error is
stamped with the time it was raised (a rank that died without a Python exception, e.g. a C++ abort in gloo's
thread, with the time of the last line it wrote), and :meth:`Outcome.failure_report` names the first and the
ranks that failed after it, and why. Ranks still running :data:`AFTER_FAILURE_S` after the first failure are
stopped (waiting where no watchdog looks, e.g. in ``init_process_group`` for a rank that never got there).

The program is a plain script with a ``main()`` that calls ``init_process_group`` itself and returns
``{"model": ..., "losses": [...]}``; each rank runs it the way torchrun (or srun) would start it, with the
launcher's environment variables. The ranks are forked from a process that imported torch once, so a run
starts in a fraction of a second. Their output is kept and shown after the run, prefixed by the rank.
"""
from __future__ import annotations

import faulthandler
import json
import os
import pickle
import queue
import re
import runpy
import signal
import sys
import sysconfig
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labkit.dist.store import hosted_store
from labkit.dist.testing import NO_GUARD_MESSAGE, exit_if_bootstrapping, start, unguarded
from labkit.errors import ConfigError
from labkit.faults import findings, fixed_source, get
from labkit.faults.common import LOST
from labkit.faults.watchdog import refusal

_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "labkit.faults.common", "labkit.faults.recorder",
            "labkit.faults.watchdog"]
#: how long the other ranks may go on once one has failed: a peer of a failed rank fails within a second (its
#: connections close), but one that waits outside any collective, where no watchdog looks (in
#: ``init_process_group`` for a rank that died before it got there), would wait for the runner's whole timeout
AFTER_FAILURE_S = 30.0


@dataclass
class Outcome:
    """How a run of a fault's program ended, and what each rank reported."""

    status: str  # "finished", "hung" or "failed"
    ranks: list[dict] = field(default_factory=list)  # per finished rank: losses, state, record, gpu, host
    table: str = ""
    hang: dict | None = None  # the watchdog's report (reports per rank) when it hung
    findings: list[str] = field(default_factory=list)
    error: str = ""  # the first failure's traceback (or what the rank printed last)
    logs: dict[int, str] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)  # {rank, time, message, error}, ordered by time
    lost: list[int] = field(default_factory=list)  # ranks the program lost on purpose (exit code common.LOST)

    def state(self, rank: int = 0) -> dict:
        return next(r["state"] for r in self.ranks if r["rank"] == rank)

    def failure_report(self) -> list[str]:
        """``rank 1 failed first, at 05:41:07.123 UTC: ValueError: ...``, then one line per rank that failed after
        it, with how much later and its own error (usually the first one's consequence)."""
        if not self.failures:
            return []
        first = self.failures[0]
        clock = time.strftime("%H:%M:%S", time.gmtime(first["time"])) + f"{first['time'] % 1:.3f}"[1:]
        lines = [f"rank {first['rank']} failed first, at {clock} UTC: {first['message']}"]
        lines += [f"then rank {f['rank']}, {f['time'] - first['time']:.3f} s later: {f['message']}"
                  for f in self.failures[1:]]
        return lines


def _launcher_env(launcher: str, rank: int, world_size: int, rendezvous: dict[str, str]) -> dict[str, str]:
    """What a rank gets from the launcher: its place, and where the store is (:mod:`labkit.dist.store`)."""
    env = dict(rendezvous)
    if launcher == "srun":  # srun --ntasks-per-node N on one node: SLURM's variables, not torchrun's
        return {**env, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size), "SLURM_LOCALID": str(rank),
                "SLURM_NODEID": "0", "SLURMD_NODENAME": "node0"}
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size)}


def _rank_main(path, rank, world_size, rendezvous, launcher, seconds, tmp, extra_env, environ, results):
    from labkit.faults import common, recorder
    from labkit.faults.watchdog import Watchdog

    with open(Path(tmp) / f"rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    faulthandler.enable()  # a C++ abort (gloo's checks) prints each thread's Python stack: where the rank was
    os.environ.clear()
    os.environ.update(environ, **_launcher_env(launcher, rank, world_size, rendezvous), **extra_env)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if launcher == "srun" else ():
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    dist.set_debug_level_from_env()  # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it
    if seconds is not None:  # None: the program starts its own (labkit train --watchdog)
        Watchdog(seconds, Path(tmp) / "hang.json", echo=False).start()
    recorder.install()
    try:
        main = runpy.run_path(str(path), run_name="__labkit_fault__").get("main")
        if not callable(main):
            raise TypeError(f"{Path(path).name} defines no main(): keep the program's main() and what it returns")
        out = main()
        record = recorder.finish()
        if not isinstance(out, dict) or "model" not in out:
            raise TypeError("main() must return a dict with the trained 'model' (and its 'losses')")
        extras = {k: v for k, v in out.items() if k not in ("model", "losses") and isinstance(v, (int, float, str))}
        payload = {"rank": rank, "losses": [float(v) for v in out.get("losses", [])], "extras": extras,
                   "state": {k: v.detach().cpu() for k, v in out["model"].state_dict().items()},
                   "record": record, "gpu": common.chosen_gpu, "host": os.environ.get("SLURMD_NODENAME", "")}
        results.put((rank, True, pickle.dumps(payload)))
    except BaseException as exc:
        when = time.time()
        first = str(exc).strip().splitlines()
        message = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
        results.put((rank, False, pickle.dumps({"time": when, "message": message, "error": traceback.format_exc()})))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_program(path: str | Path, ranks: int = 2, watchdog: float | None = 10.0, launcher: str = "torchrun",
                env: dict[str, str] | None = None, timeout: float = 300.0,
                echo: Callable[[str], None] | None = None, lost: int | None = None) -> Outcome:
    """Run the program at ``path`` on ``ranks`` local ranks; see the module's docstring.

    Args:
        watchdog: seconds a rank may wait in one collective before the run counts as hung (None: no
            watchdog of the runner's; the program may start its own).
        launcher: ``"torchrun"`` or ``"srun"`` (which variables the ranks get).
        env: extra environment variables for the ranks (e.g. ``{"DEVICE": "cuda"}``).
        timeout: a last resort for what the watchdog cannot see (a rank stuck outside any collective).
        echo: called with each line the ranks printed, ``[rank N] ...`` (after the run).
        lost: the rank the program loses on purpose: its exit with code :data:`labkit.faults.common.LOST` is the
            scenario (``Outcome.lost``), not a failure.
    """
    exit_if_bootstrapping()
    if watchdog is not None and (env or {}).get("DEVICE", "cpu") == "cpu" and (why := refusal("gloo")) is not None:
        raise ConfigError(why)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="labkit-fault-") as tmp, hosted_store(ctx) as rendezvous:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(str(Path(path).resolve()), r, ranks, rendezvous, launcher, watchdog, tmp, env or {},
                                   dict(os.environ), results)) for r in range(ranks)]
        start(procs)
        done, failed, ended, first = _gather(procs, results, ranks, time.monotonic() + timeout)
        logs = {r: (Path(tmp) / f"rank{r}.log").read_text(errors="replace")
                for r in range(ranks) if (Path(tmp) / f"rank{r}.log").exists()}
        for r in set(range(ranks)) - set(done) - set(failed):
            failed[r] = _silent(procs[r], Path(tmp) / f"rank{r}.log", logs.get(r, ""), ended.get(r), first)
        hang_file = Path(tmp) / "hang.json"
        hang = json.loads(hang_file.read_text()) if hang_file.exists() else None
    if unguarded(procs):
        raise RuntimeError(NO_GUARD_MESSAGE)
    if echo is not None:
        for r, text in logs.items():
            for line in text.splitlines():
                echo(f"[rank {r}] {line}")
    per_rank = [done[r] for r in sorted(done)]
    gone = [r for r in failed if r == lost and procs[r].exitcode == LOST]
    for r in gone:
        del failed[r]
    if hang is not None:
        return Outcome("hung", per_rank, hang["table"], hang, logs=logs, lost=gone)
    if failed:
        failures = sorted(({"rank": r, **f} for r, f in failed.items()), key=lambda f: (f["time"], f["rank"]))
        return Outcome("failed", per_rank, error=failures[0]["error"], logs=logs, failures=failures, lost=gone)
    return Outcome("finished", per_rank, findings=findings.silent(per_rank), logs=logs, lost=gone)


def _silent(proc, log: Path, text: str, ended: float | None, first: int | None = None) -> dict:
    """A rank that ended without a result or a Python exception: a C++ abort (gloo's ``EnforceNotMet`` in its
    own thread), a signal, or the runner's timeout (``first``: the rank whose failure cut it short). Its last
    words are the last line of its output, written just before it died, so the log's modification time dates
    them; with no output, the time it was seen gone."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = next((line.removeprefix("what():").strip() for line in lines if line.startswith("what():")),
                next((line for line in lines if line.startswith("Fatal Python error")), lines[-1] if lines else ""))
    code = proc.exitcode
    if (ended is None or code is None) and first is not None:
        how = f"still running {AFTER_FAILURE_S:.0f} s after rank {first} failed"
    elif ended is None or code is None:
        how = "still running at the runner's timeout"
    elif code < 0:
        how = f"killed by signal {signal.Signals(-code).name if -code in iter(signal.Signals) else -code}"
    else:
        how = f"exit code {code}"
    at = _user_line(text)
    how += f"{' in ' + at if at else ''}, without a Python exception"
    when = time.time() if ended is None else log.stat().st_mtime if lines and log.exists() else ended
    return {"time": when, "message": f"{said or 'no output'} ({how})", "error": f"{text.rstrip()}\n({how})"}


def _user_line(text: str) -> str:
    """``ff.py:34``: the innermost line of the rank's own program in the main thread's stack that
    :mod:`faulthandler` printed when the rank died ('' when it printed none)."""
    stacks = [block for block in text.split("\n\n") if "in _rank_main" in block]
    frames = re.findall(r'File "(.+)", line (\d+) in ', stacks[-1]) if stacks else []
    here = Path(__file__).parent
    ours = (str(Path(torch.__file__).parent), sysconfig.get_paths()["stdlib"],
            *(str(here / f"{name}.py") for name in ("runner", "recorder", "watchdog")))
    return next((f"{Path(f).name}:{n}" for f, n in frames if not f.startswith(ours) and not f.startswith("<")), "")


def _gather(procs, results, ranks: int, deadline: float) -> tuple[dict[int, dict], dict[int, dict], dict[int, float],
                                                                 int | None]:
    """The ranks' results, their failures, the time each rank was first seen gone without one, and the rank
    whose failure (reported, or gone without a result) ended the wait :data:`AFTER_FAILURE_S` later (None: the
    ranks ended, or the runner's timeout came, before that)."""
    done: dict[int, dict] = {}
    failed: dict[int, dict] = {}
    ended: dict[int, float] = {}
    first, cutoff = None, deadline

    def all_gone() -> bool:
        for r, p in enumerate(procs):
            if r not in ended and not p.is_alive():
                ended[r] = time.time()
        return len(ended) == len(procs)

    try:
        while len(done) + len(failed) < ranks and time.monotonic() < cutoff:
            all_gone()
            try:
                rank, ok, out = results.get(timeout=0.2)
            except queue.Empty:
                if all_gone():
                    try:  # a last result may be in flight
                        rank, ok, out = results.get(timeout=1.0)
                    except queue.Empty:
                        break
                else:
                    rank = None
            if rank is not None:
                (done if ok else failed)[rank] = pickle.loads(out)
            if first is None:
                gone = [r for r in ended if r not in done and procs[r].exitcode not in (0, LOST)]
                culprits = sorted(failed, key=lambda r: failed[r]["time"]) or sorted(gone, key=ended.get)
                if culprits:
                    first, cutoff = culprits[0], min(deadline, time.monotonic() + AFTER_FAILURE_S)
    finally:
        for p in procs:
            p.join(timeout=20 if p.is_alive() and time.monotonic() < cutoff else 1)
            if p.is_alive():
                p.kill()
                p.join()
    return done, failed, ended, first if cutoff < deadline else None


def run_fault(name: str, fixed: bool = False, **kwargs) -> Outcome:
    """Run fault ``name``'s broken program (or, with ``fixed``, its fixed version) through :func:`run_program`."""
    fault = get(name)
    if not fixed:
        return run_program(fault.path, launcher=fault.launcher, lost=fault.lost, **kwargs)
    with tempfile.TemporaryDirectory(prefix="labkit-fixed-") as tmp:
        path = Path(tmp) / fault.path.name
        path.write_text(fixed_source(name))
        return run_program(path, launcher=fault.launcher, lost=fault.lost, **kwargs)


def _doctor_rank(argv, rank, world_size, rendezvous, tmp, environ):
    from labkit.cli import main

    with open(Path(tmp) / f"rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ.clear()
    os.environ.update(environ, **_launcher_env("torchrun", rank, world_size, rendezvous))
    torch.set_num_threads(1)
    code = main(["doctor", *argv])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_script(argv: list[str], ranks: int = 2, timeout: float = 120.0) -> dict[int, tuple[int | None, str]]:
    """Run ``labkit doctor ARGV`` (its flags, then any plain script and its arguments) on ``ranks`` local ranks
    with torchrun's variables, as ``python -m labkit.dist.torchrun`` starts them, but forked from the process
    that imported torch once; each rank's exit code (None: killed at ``timeout``) and output."""
    exit_if_bootstrapping()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="labkit-doctor-") as tmp, hosted_store(ctx) as rendezvous:
        procs = [ctx.Process(target=_doctor_rank, daemon=True,
                             args=(list(argv), r, ranks, rendezvous, tmp, dict(os.environ))) for r in range(ranks)]
        start(procs)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = []
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
                codes.append(None)
            else:
                codes.append(p.exitcode)
        return {r: (codes[r], (Path(tmp) / f"rank{r}.log").read_text(errors="replace")) for r in range(ranks)}

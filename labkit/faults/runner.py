"""Run a fault program (or a learner's fix of it) on local gloo ranks under the watchdog, and diagnose it.

    outcome = run_program("my_fix.py", ranks=2, watchdog=5)
    outcome.status        # "finished", "hung" or "failed"
    outcome.table         # the watchdog's table when it hung
    outcome.findings      # what the silent-failure checks found (labkit.faults.findings)

The program is a plain script with a ``main()`` that calls ``init_process_group`` itself and returns
``{"model": ..., "losses": [...]}``; each rank runs it the way torchrun (or srun) would start it, with the
launcher's environment variables. The ranks are forked from a process that imported torch once, so a run
starts in a fraction of a second. Their output is kept and shown after the run, prefixed by the rank.
"""
from __future__ import annotations

import json
import os
import pickle
import queue
import runpy
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labkit.dist.testing import NO_GUARD_MESSAGE, exit_if_bootstrapping, free_port, start, unguarded
from labkit.errors import ConfigError
from labkit.faults import findings, fixed_source, get
from labkit.faults.watchdog import refusal

_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "labkit.faults.common", "labkit.faults.recorder",
            "labkit.faults.watchdog"]


@dataclass
class Outcome:
    """How a run of a fault's program ended, and what each rank reported."""

    status: str  # "finished", "hung" or "failed"
    ranks: list[dict] = field(default_factory=list)  # per finished rank: losses, state, record, gpu, host
    table: str = ""
    hang: dict | None = None  # the watchdog's report (reports per rank) when it hung
    findings: list[str] = field(default_factory=list)
    error: str = ""
    logs: dict[int, str] = field(default_factory=dict)

    def state(self, rank: int = 0) -> dict:
        return next(r["state"] for r in self.ranks if r["rank"] == rank)


def _launcher_env(launcher: str, rank: int, world_size: int, port: int) -> dict[str, str]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if launcher == "srun":  # srun --ntasks-per-node N on one node: SLURM's variables, not torchrun's
        return {**env, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size), "SLURM_LOCALID": str(rank),
                "SLURM_NODEID": "0", "SLURMD_NODENAME": "node0"}
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size)}


def _rank_main(path, rank, world_size, port, launcher, seconds, tmp, extra_env, environ, results):
    from labkit.faults import common, recorder
    from labkit.faults.watchdog import Watchdog

    with open(Path(tmp) / f"rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ.clear()
    os.environ.update(environ, **_launcher_env(launcher, rank, world_size, port), **extra_env)
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
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_program(path: str | Path, ranks: int = 2, watchdog: float | None = 10.0, launcher: str = "torchrun",
                env: dict[str, str] | None = None, timeout: float = 300.0,
                echo: Callable[[str], None] | None = None) -> Outcome:
    """Run the program at ``path`` on ``ranks`` local ranks; see the module's docstring.

    Args:
        watchdog: seconds a rank may wait in one collective before the run counts as hung (None: no
            watchdog of the runner's; the program may start its own).
        launcher: ``"torchrun"`` or ``"srun"`` (which variables the ranks get).
        env: extra environment variables for the ranks (e.g. ``{"DEVICE": "cuda"}``).
        timeout: a last resort for what the watchdog cannot see (a rank stuck outside any collective).
        echo: called with each line the ranks printed, ``[rank N] ...`` (after the run).
    """
    exit_if_bootstrapping()
    if watchdog is not None and (env or {}).get("DEVICE", "cpu") == "cpu" and (why := refusal("gloo")) is not None:
        raise ConfigError(why)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="labkit-fault-") as tmp:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(str(Path(path).resolve()), r, ranks, port, launcher, watchdog, tmp, env or {},
                                   dict(os.environ), results)) for r in range(ranks)]
        start(procs)
        done, failed = _gather(procs, results, ranks, time.monotonic() + timeout)
        logs = {r: (Path(tmp) / f"rank{r}.log").read_text(errors="replace")
                for r in range(ranks) if (Path(tmp) / f"rank{r}.log").exists()}
        hang_file = Path(tmp) / "hang.json"
        hang = json.loads(hang_file.read_text()) if hang_file.exists() else None
    if unguarded(procs):
        raise RuntimeError(NO_GUARD_MESSAGE)
    if echo is not None:
        for r, text in logs.items():
            for line in text.splitlines():
                echo(f"[rank {r}] {line}")
    per_rank = [done[r] for r in sorted(done)]
    if hang is not None:
        return Outcome("hung", per_rank, hang["table"], hang, logs=logs)
    if failed or len(done) < ranks:
        first = failed[min(failed)] if failed else f"ranks {sorted(set(range(ranks)) - set(done))} ended silently"
        return Outcome("failed", per_rank, error=first, logs=logs)
    return Outcome("finished", per_rank, findings=findings.silent(per_rank), logs=logs)


def _gather(procs, results, ranks: int, deadline: float) -> tuple[dict[int, dict], dict[int, str]]:
    done: dict[int, dict] = {}
    failed: dict[int, str] = {}
    try:
        while len(done) + len(failed) < ranks and time.monotonic() < deadline:
            try:
                rank, ok, out = results.get(timeout=0.2)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    try:  # a last result may be in flight
                        rank, ok, out = results.get(timeout=1.0)
                    except queue.Empty:
                        break
                else:
                    continue
            if ok:
                done[rank] = pickle.loads(out)
            else:
                failed[rank] = out
    finally:
        for p in procs:
            p.join(timeout=20 if p.is_alive() and time.monotonic() < deadline else 1)
            if p.is_alive():
                p.kill()
                p.join()
    return done, failed


def run_fault(name: str, fixed: bool = False, **kwargs) -> Outcome:
    """Run fault ``name``'s broken program (or, with ``fixed``, its fixed version) through :func:`run_program`."""
    fault = get(name)
    if not fixed:
        return run_program(fault.path, launcher=fault.launcher, **kwargs)
    with tempfile.TemporaryDirectory(prefix="labkit-fixed-") as tmp:
        path = Path(tmp) / fault.path.name
        path.write_text(fixed_source(name))
        return run_program(path, launcher=fault.launcher, **kwargs)

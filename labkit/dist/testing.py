"""Run a function on N gloo ranks on this machine: the helper behind every multi-rank test and check.

    def grads_on_rank(env, x):
        ...                        # runs inside labkit.dist.group.distributed(device="cpu")
        return tensor

    per_rank = run_ranks(grads_on_rank, 3, x)   # [rank0_result, rank1_result, rank2_result]

The ranks are forked from a process that imported torch once (and ``torch._dynamo``, which every optimizer's
constructor imports: 2 s of a rank's start here), so a rank starts in a fraction of a second instead of importing
them anew (seconds each, and several ranks share the cores). On Linux, where the caller has not initialised CUDA
or a process group of its own, that process is the caller itself (``fork``): it imports what a rank needs once
(:data:`_PRELOAD`) and forks. Otherwise it is multiprocessing's *forkserver*, started once per program with the
same imports. Each rank takes the caller's current environment variables, working directory and ``sys.path``,
one compute thread (a forked rank must not use the OpenMP pool its parent may have started: it would hang), and
fresh ``sys.stdout``/``sys.stderr`` on file descriptors 1 and 2 (the caller's may be a notebook's, which only
its own process can write to).
"""
from __future__ import annotations

import ast
import importlib
import io
import os
import pickle
import queue
import random
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from labkit.dist.store import hosted_store


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now, for a server that binds it later (a notebook server,
    a multi-node rendezvous): one at random below the range the system hands out to ``bind(0)`` and to outgoing
    connections (``ip_local_port_range``), so that between now and then only another caller of this function
    could take it, not any connection on the machine. Ranks started here need none (:mod:`labkit.dist.store`)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    # below the system's range, and not torchrun's defaults (29500 and the job scripts' 29500 + job id mod 1000)
    ports = [p for p in range(20000, low) if not 29000 <= p < 31000]
    for port in random.SystemRandom().sample(ports, min(len(ports), 64)):  # not the seeded generator
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the system's range
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: what the ranks' parent imports once, so that no rank imports it again ("__main__": the caller's script, as spawn;
#: labkit.train.run: what every rank that trains imports, models and data included)
_PRELOAD = ["__main__", "torch", "torch.distributed", "torch._dynamo", "labkit.dist.group", "labkit.train.run"]


#: the exit code of a rank that found itself re-running a script without a ``__main__`` guard
_NO_GUARD_EXIT = 71
NO_GUARD_MESSAGE = ("the script that starts ranks runs again in every rank (to find its functions), so it must "
                    "start them under `if __name__ == \"__main__\":`; move the call into that block")


def exit_if_bootstrapping() -> None:
    """In a rank that is still importing the caller's script (which called us at its top level): end the rank
    at once, quietly, with the code the parent reads as :data:`NO_GUARD_MESSAGE` (Python's own start method
    would raise there, in every rank, and leave the parent waiting for their results). In the caller, raise
    that message before any rank starts where its script's source shows the call outside the guard (no
    forkserver started to import torch only for its ranks to end)."""
    if getattr(mp.current_process(), "_inheriting", False):
        os._exit(_NO_GUARD_EXIT)
    if _called_outside_main_guard():
        raise RuntimeError(NO_GUARD_MESSAGE)


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` (either side, or within a larger condition)."""
    if not isinstance(node, ast.If):
        return False
    for cmp in ast.walk(node.test):
        sides = (cmp.left, *cmp.comparators) if isinstance(cmp, ast.Compare) else ()
        if (any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides) and
                any(isinstance(side, ast.Constant) and side.value == "__main__" for side in sides)):
            return True
    return False


def _called_outside_main_guard() -> bool:
    """Whether the caller's script, the one a started process imports again (as ``multiprocessing.spawn``
    decides: run as a file, or ``-m`` a module not named ``__main__``), runs now at its top level outside
    ``if __name__ == "__main__":``. False where the source cannot tell (no file, a notebook): the ranks do."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if path is None or spec_name == "__main__" or (spec_name or "").endswith(".__main__"):
        return False
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # not under the script's top level on this thread (another thread, a later callback)
        return False
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    line = frame.f_lineno
    return not any(_is_main_guard(node) and node.body[0].lineno <= line <= node.body[-1].end_lineno
                   for node in ast.walk(tree))


def unguarded(procs) -> bool:
    """Whether a rank ended because the caller's script has no ``__main__`` guard."""
    return any(p.exitcode == _NO_GUARD_EXIT for p in procs)


def start(procs) -> None:
    """Start ``procs``; where the forkserver itself ran the caller's script (Pythons whose forkserver imports
    ``__main__`` to preload it) and ended there, raise :data:`NO_GUARD_MESSAGE` instead of its broken pipe."""
    try:
        for p in procs:
            p.start()
    except (EOFError, OSError):
        from multiprocessing import forkserver

        pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
        for _ in range(20) if pid is not None else ():  # its connection broke as it ended: wait for its code
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # peek, leave it to reap
            if ended is not None:
                if ended.si_code == os.CLD_EXITED and ended.si_status == _NO_GUARD_EXIT:
                    raise RuntimeError(NO_GUARD_MESSAGE) from None
                break
            time.sleep(0.1)
        raise


def rank_context():
    """Where ranks come from (see the module's docstring): this process, forked, where that is safe; else the
    forkserver, with the same :data:`_PRELOAD`."""
    import torch.distributed as dist

    if sys.platform.startswith("linux") and not torch.cuda.is_initialized() and not (
            dist.is_available() and dist.is_initialized()):
        for module in _PRELOAD[1:]:  # once here, not in every rank ("__main__": this process's own script)
            importlib.import_module(module)
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_inherited: list = []


def _fresh_stdio() -> None:
    """``sys.stdout``/``sys.stderr`` anew on file descriptors 1 and 2: a rank forked from a notebook kernel holds
    the kernel's streams, which only the kernel's own threads can send (the old ones are kept: freeing them here
    could run their finalisers)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        _inherited.append(getattr(sys, name))
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True))


def _caller() -> dict:
    """The state a spawned process would inherit from the caller now (a forked rank starts from the server's)."""
    return {"environ": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)}


def _become_rank(rank, world_size, rendezvous, caller):
    """Take the caller's state and the variables torchrun (or srun, through labkit's launch_info) gives a rank;
    ``rendezvous``: where the store is (:func:`labkit.dist.store.hosted_store`)."""
    os.environ.clear()
    os.environ.update(caller["environ"], RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), **rendezvous)
    os.chdir(caller["cwd"])
    sys.path[:] = caller["sys_path"]
    torch.set_num_threads(1)
    _fresh_stdio()


def _rank_main(payload, rank, world_size, rendezvous, timeout_s, results, caller):
    _become_rank(rank, world_size, rendezvous, caller)
    try:
        from labkit.dist.group import distributed

        fn, args, kwargs = pickle.loads(payload)  # after sys.path: fn's module may live on the caller's path
        with distributed(device="cpu", backend="gloo", timeout_s=timeout_s) as env:
            out = fn(env, *args, **kwargs)
        # plain pickle copies tensors; torch's queue reducers would share memory that dies with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # the parent re-raises it with this rank's traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0, **kwargs) -> list[Any]:
    """Start ``world_size`` processes, run ``fn(env, *args, **kwargs)`` on each, return their results.

    Args:
        fn: a module-level function (pickled by name) taking a :class:`labkit.dist.group.DistEnv`.
        world_size: number of ranks (>= 1).
        timeout: seconds for the whole run; also the collective timeout inside the ranks.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RuntimeError: a rank raised; the message holds its traceback.
        TimeoutError: the ranks did not finish within ``timeout`` (they are killed).
    """
    exit_if_bootstrapping()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = rank_context()
    with hosted_store(ctx) as rendezvous:
        return _run_ranks(ctx, rendezvous, fn, world_size, args, kwargs, timeout)


def _run_ranks(ctx, rendezvous, fn, world_size, args, kwargs, timeout):
    results = ctx.Queue()
    payload = pickle.dumps((fn, args, kwargs))
    procs = [ctx.Process(target=_rank_main, args=(payload, r, world_size, rendezvous, timeout, results, _caller()),
                         daemon=True) for r in range(world_size)]
    start(procs)
    collected: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    last = time.monotonic()
    ended: set[int] = set()
    try:
        while len(collected) + len(failures) < world_size:
            try:
                rank, ok, out = results.get(timeout=0.5)
            except queue.Empty:
                if unguarded(procs):
                    raise RuntimeError(NO_GUARD_MESSAGE) from None
                for r in ended:  # ended before the last wait began, without a word: killed
                    if r not in collected and r not in failures:
                        failures[r] = f"rank {r} ended (exit code {procs[r].exitcode}) without returning\n"
                        last = time.monotonic()
                ended = {r for r, p in enumerate(procs) if p.exitcode is not None}
                now = time.monotonic()
                if failures and now - last > 3.0:  # peers of a failed rank fail next (connection reset)
                    break
                if now > deadline:
                    raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in "
                                       f"{timeout:.0f} s")
                continue
            last = time.monotonic()
            if ok:
                collected[rank] = pickle.loads(out)
            else:
                failures[rank] = out
        if failures:
            # the root cause first: a rank whose error is not a lost connection to a peer
            order = sorted(failures, key=lambda r: ("Connection reset" in failures[r] or "Connection closed" in
                                                    failures[r], r))
            first = order[0]
            others = "".join(f"\n--- rank {r} also failed:\n{failures[r]}" for r in order[1:])
            raise RuntimeError(f"rank {first} of {world_size} failed in {fn.__name__}:\n{failures[first]}{others}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [collected[r] for r in range(world_size)]


def record_losses(strategy) -> list:
    """Record the loss of every step ``fit`` runs on ``strategy``: a copy of what its ``forward_backward``
    returns (None on a rank that does not own the loss). Returns the list it appends to."""
    losses, inner = [], strategy.forward_backward

    def forward_backward(*args):
        loss, out = inner(*args)
        losses.append(None if loss is None else loss.clone())
        return loss, out

    strategy.forward_backward = forward_backward
    return losses


def _cli_rank_main(argv, rank, world_size, rendezvous, caller, out_path, err_path):
    """``labkit ARGV`` as rank ``rank``: its output into two files, its exit code the process's."""
    _become_rank(rank, world_size, rendezvous, caller)
    for fd, path in ((1, out_path), (2, err_path)):  # the file descriptors: C++ warnings are caught too
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file, fd)
        os.close(file)
    try:
        from labkit.cli import main

        code = main(list(argv))
    except SystemExit as exc:  # a bad flag: argparse's exit
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a crash shows its traceback, as it would in a terminal
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run_cli_ranks(argv: list[str], world_size: int, timeout: float = 120.0) -> list[tuple[int, str, str]]:
    """``labkit ARGV`` (e.g. ``["train", "--strategy", "ddp", ...]``) on ``world_size`` ranks forked as
    :func:`run_ranks` forks them, each set up as torchrun or srun would (``RANK``, ``WORLD_SIZE``, ...), and
    the command's own ``labkit.dist.group.distributed`` starting the process group: the ``labkit`` command's whole
    path but the launcher's.

    Returns:
        ``[(exit code, stdout, stderr) of rank 0, ...]``; a rank killed by a signal has the negative signal
        number as its code (``-9``: SIGKILL), and what it wrote before it died.

    Raises:
        TimeoutError: a rank still ran after ``timeout`` seconds (every rank is killed).
    """
    exit_if_bootstrapping()
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = rank_context()
    with tempfile.TemporaryDirectory(prefix="labkit-ranks-") as tmp, hosted_store(ctx) as rendezvous:
        paths = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(world_size)]
        procs = [ctx.Process(target=_cli_rank_main, daemon=True,
                             args=(list(argv), r, world_size, rendezvous, _caller(), *paths[r]))
                 for r in range(world_size)]
        start(procs)
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
            if any(p.is_alive() for p in procs):
                raise TimeoutError(f"labkit {' '.join(argv[:1])} on {world_size} ranks did not finish in "
                                   f"{timeout:.0f} s")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [(p.exitcode, *(Path(path).read_text(errors="replace") for path in paths[r]))
                for r, p in enumerate(procs)]

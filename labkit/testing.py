"""Run a function on N gloo ranks on this machine: the helper behind every multi-rank test and check.

    def grads_on_rank(env, x):
        ...                        # runs inside labkit.dist.distributed(device="cpu")
        return tensor

    per_rank = run_ranks(grads_on_rank, 3, x)   # [rank0_result, rank1_result, rank2_result]
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, rank, world_size, port, timeout_s, results, environ, args, kwargs):
    from labkit.dist import distributed

    os.environ.clear()  # the caller's environment as it is now, not the fork server's from when it started
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        with distributed(device="cpu", backend="gloo", timeout_s=timeout_s) as env:
            out = fn(env, *args, **kwargs)
        # plain pickle copies tensors; torch's queue reducers would share memory that dies with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # the parent re-raises it with this rank's traceback
        results.put((rank, False, traceback.format_exc()))


def _context():
    """A fork server that imported torch once: each rank is a fork of it (milliseconds) instead of a fresh
    interpreter importing torch again (seconds). The server itself never runs torch code, so no thread pool or
    process group is copied into the ranks; like ``spawn``, ``fn`` and its arguments travel pickled."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torchvision"])
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0, **kwargs) -> list[Any]:
    """Spawn ``world_size`` processes, run ``fn(env, *args, **kwargs)`` on each, return their results.

    Args:
        fn: a module-level function (pickled by name) taking a :class:`labkit.dist.DistEnv`.
        world_size: number of ranks (>= 1).
        timeout: seconds for the whole run; also the collective timeout inside the ranks.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RuntimeError: a rank raised; the message holds its traceback.
        TimeoutError: the ranks did not finish within ``timeout`` (they are killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, timeout, results, dict(os.environ), args,
                                                  kwargs), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) + len(failures) < world_size:
            wait = deadline - time.monotonic()
            if failures:  # peers of a failed rank fail next (connection reset): gather them briefly
                wait = min(wait, 3.0)
            try:
                rank, ok, out = results.get(timeout=max(0.1, wait))
            except queue.Empty:
                if failures:
                    break
                raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in {timeout:.0f} s")
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

"""The hang watchdog: when a rank has waited in one collective for more than SECONDS, every rank says where it
is, rank 0 prints one table (:mod:`labkit.faults.table`) and the job ends with exit code 124.

    Watchdog(seconds=300).start()      # in each rank, before init_process_group
    labkit train --watchdog 300 ...     # the same for every labkit training run (or LABKIT_WATCHDOG=300)

What a rank is doing comes from PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE``: the process group keeps
its last collectives with operation, sequence number, shapes, dtypes, group and whether each finished; gloo
and NCCL keep one buffer each and both are read; it sees the collectives DDP issues from C++ too).
Point-to-point ``send``/``recv``, which gloo's recorder leaves out, are noted by a thin wrapper. The Python
line each rank is on comes from ``sys._current_frames()`` (a thread may read the main thread's stack while it
waits in C++), so no debugger or ``ptrace`` permission is needed. A background thread checks its own rank's
flight recorder every half second and the job's store every few seconds; a training step gains no collective
and no host sync. Should the store be gone (the rank that held it died), a stuck rank reports alone.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.faults.table import hang_table

EXIT_HUNG = 124
FR_ENV = "TORCH_FR_BUFFER_SIZE"
#: store keys per torchrun attempt: a restarted group may share the store with the one that hung
_KEY = f"labkit-watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
_HERE = Path(__file__).parent
_INTERNAL = (str(Path(torch.__file__).parent), sysconfig.get_paths()["stdlib"], str(_HERE / "runner.py"),
             str(_HERE / "watchdog.py"), str(_HERE / "recorder.py"))
#: the kit's own frames between a learner's script and its collective (labkit doctor, --check-collectives)
_INTERNAL += (str(_HERE / "doctor.py"), str(_HERE / "consistency.py"), str(_HERE.parent / "cli.py"),
              str(_HERE.parent / "__main__.py"))
_C10D = dist.distributed_c10d.__file__
#: what a rank's collective call was given that the flight recorder does not keep: its root, its reduce op
_ROOTS = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src"}
_REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
#: the call a rank is checking with the other ranks (labkit.faults.consistency), before it is issued
CHECKING: dict = {"current": None}
#: set once the watchdog is ending this process (os._exit(124) follows): a main thread whose collective fails
#: meanwhile, as its peers leave, waits for it rather than exit with a code of its own (labkit doctor)
ENDING = threading.Event()
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Byte": "uint8", "Bool": "bool"}
_p2p: dict = {"seq": 0, "current": None, "done": []}
#: the kit's own bookkeeping collectives, by the file that issues them: a rank is not "waiting" in one of these
#: while one of the training's own collectives is in flight (the stop check's all-reduce is read a step later)
BOOKKEEPING = {str(_HERE.parent / "train" / "preempt.py"): "labkit's stop check"}


def _record_p2p(name: str, fn):
    def wrapper(tensor, *args, **kwargs):
        peer = args[0] if args else kwargs.get("dst" if name == "send" else "src")
        _p2p["seq"] += 1
        _p2p["current"] = {"op": name, "seq": _p2p["seq"], "shape": list(tensor.shape),
                           "dtype": str(tensor.dtype).replace("torch.", ""), "peer": peer, "group": "",
                           "since": time.time()}
        try:
            return fn(tensor, *args, **kwargs)
        finally:
            _p2p["done"] = [*_p2p["done"][-2:], _p2p["current"]]
            _p2p["current"] = None
    wrapper.labkit_recorded = fn
    return wrapper


def _patch_p2p() -> None:
    for name in ("send", "recv"):
        fn = getattr(dist, name)
        if not hasattr(fn, "labkit_recorded"):
            setattr(dist, name, _record_p2p(name, fn))


def _entry(e: dict) -> dict:
    """A flight-recorder entry in the table's terms (``kit``: the label of a bookkeeping collective, else absent)."""
    group = e.get("process_group") or ["", ""]
    entry = {"op": e["profiling_name"].split(":")[-1], "seq": e["collective_seq_id"],
             "shape": list((e.get("input_sizes") or [[]])[0]) if e.get("input_sizes") else None,
             "dtype": _DTYPES.get((e.get("input_dtypes") or [""])[0], ""), "group": group[1] or str(e.get("pg_id", "")),
             "since": e["time_created_ns"] / 1e9, "done": bool(e.get("retired"))}
    kit = next((BOOKKEEPING[f["filename"]] for f in e.get("frames") or () if f.get("filename") in BOOKKEEPING), None)
    return entry if kit is None else {**entry, "kit": kit}


def recorded() -> list[dict]:
    """This rank's flight-recorder entries (collectives only; oldest first); [] when it records nothing.

    Gloo's and NCCL's recorders are separate buffers with a dump each; both are read, with the Python stack
    each collective was issued from (which tells the kit's bookkeeping apart).
    """
    from torch._C import _distributed_c10d as c10d

    entries = []
    for dump in ("_dump_fr_trace", "_dump_nccl_trace"):
        if hasattr(c10d, dump):
            entries += pickle.loads(getattr(c10d, dump)(True, True, False)).get("entries", [])
    entries.sort(key=lambda e: e["time_created_ns"])
    return [_entry(e) for e in entries if not e.get("is_p2p")]


def waiting_in(entries: list[dict]) -> dict | None:
    """The collective a rank waits in: its oldest unfinished one, passing over the kit's bookkeeping collectives
    while one of the program's own is unfinished (the rank is blocked in that one; a bookkeeping all-reduce in
    flight is only read later). None when every collective finished."""
    pending = [e for e in entries if not e["done"]]
    return next((e for e in pending if "kit" not in e), pending[0] if pending else None)


def _internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL) or filename.startswith("<")


def where(thread_id: int | None = None) -> str:
    """The innermost line of user code the thread (default: the main thread) is on, and its caller's."""
    frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    if frame is None:
        return "?"
    user = [f for f in traceback.extract_stack(frame) if not _internal(f.filename)]
    lines = [f"{Path(f.filename).name}:{f.lineno} {(f.line or '').split('  #')[0].strip()}" for f in user[-2:]]
    return " < ".join(reversed(lines)) or "?"


def arguments(op: dict | None, thread_id: int | None = None) -> dict | None:
    """``op`` (a call the thread is in) with its root and reduce op, read from the arguments of the thread's
    ``torch.distributed`` frame of that name: no wrapper, the call's own frame."""
    frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    while op is not None and frame is not None:
        name, local = frame.f_code.co_name, frame.f_locals
        if frame.f_code.co_filename == _C10D and name == op["op"]:
            op = dict(op)
            if name in _ROOTS:
                root = local.get(_ROOTS[name])
                op["root"] = root if root is not None else f"group rank {local.get('group_' + _ROOTS[name])}"
            if name in _REDUCING and local.get("op") is not None:
                op["reduce_op"] = str(getattr(local["op"], "op", local["op"])).split(".")[-1]
            break
        frame = frame.f_back
    return op


def snapshot() -> dict:
    """Where this rank is: the collective it waits in (or None), the last ones it completed, its Python line."""
    entries = recorded()
    current = waiting_in(entries) or _p2p["current"]
    current = arguments(current) or CHECKING["current"]
    done = [e for e in entries if e["done"]][-2:] + _p2p["done"][-1:]
    return {"rank": dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0)),
            "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "pid": os.getpid(),
            "current": current, "completed": done, "where": where()}


class Watchdog:
    """Start in each rank before its process group exists; see the module's docstring."""

    def __init__(self, seconds: float, report_file: str | Path | None = None, poll_s: float = 0.5,
                 echo: bool = True):
        self.seconds, self.poll_s, self.echo = float(seconds), poll_s, echo
        self.report_file = None if report_file is None else Path(report_file)
        self.store_every = min(5.0, max(poll_s, self.seconds / 10))

    def start(self) -> Watchdog:
        os.environ.setdefault(FR_ENV, "64")  # read when the process group is created
        _patch_p2p()
        threading.Thread(target=self._loop, name="labkit-watchdog", daemon=True).start()
        return self

    def stuck_s(self, state: dict) -> float:
        current = state["current"]
        return 0.0 if current is None else time.time() - current["since"]

    def _loop(self) -> None:
        last_store = 0.0
        while True:
            time.sleep(self.poll_s)
            try:
                if not dist.is_initialized():
                    continue
                store = dist.distributed_c10d._get_default_store()
                state = snapshot()
                hung = self.stuck_s(state) > self.seconds
            except Exception:  # a group torn down under us: keep watching the next one
                continue
            try:
                if hung:
                    store.set(f"{_KEY}/hang", str(state["rank"]))
                if hung or time.monotonic() - last_store > self.store_every:
                    last_store = time.monotonic()
                    if store.check([f"{_KEY}/hang"]):
                        self._report(store, snapshot())
            except Exception:
                if hung:  # the store went with the rank that held it: say what this rank knows, alone
                    self._alone(state)

    def _alone(self, state: dict) -> None:
        ENDING.set()
        text = hang_table([state], dist.get_world_size(), self.seconds)
        if self.echo:
            print(f"{text}\nlabkit: the job's store is unreachable (its host rank died?): rank {state['rank']} "
                  "reports alone", file=sys.stderr, flush=True)
        os._exit(EXIT_HUNG)

    def _report(self, store, state: dict) -> None:
        """Post this rank's state; rank 0 gathers every rank's, prints the table; then every rank exits."""
        ENDING.set()
        rank, world = state["rank"], dist.get_world_size()
        store.set(f"{_KEY}/report/{rank}", json.dumps(state))
        if rank != 0:
            _quiet()
            deadline = time.monotonic() + 15.0
            try:  # until rank 0 has printed; its exit takes the store down, which ends the wait too
                while time.monotonic() < deadline and not store.check([f"{_KEY}/done"]):
                    time.sleep(0.1)
            finally:
                os._exit(EXIT_HUNG)
        try:
            reports = _collect(store, world, wait_s=5.0)
        except Exception:  # the store went away with a peer: report what this rank knows
            reports = [state]
        text = hang_table(reports, world, self.seconds)
        if self.echo:
            print(text, file=sys.stderr, flush=True)
        if self.report_file is not None:
            self.report_file.write_text(json.dumps({"seconds": self.seconds, "world_size": world,
                                                    "reports": reports, "table": text}))
        _quiet()
        try:
            store.set(f"{_KEY}/done", "1")
            time.sleep(0.5)  # the store lives in rank 0 under torchrun's c10d rendezvous: let the others read it
        finally:
            os._exit(EXIT_HUNG)


def _quiet() -> None:
    """Silence this process: what its main thread says once its peers vanish is noise after the report."""
    sys.stdout.flush()
    sys.stderr.flush()
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)


def _collect(store, world: int, wait_s: float) -> list[dict]:
    keys = [f"{_KEY}/report/{r}" for r in range(world)]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not store.check(keys):
        time.sleep(0.1)
    return [json.loads(store.get(k)) for k in keys if store.check([k])]


def refusal(backend: str) -> str | None:
    """Why the watchdog cannot see where ``backend``'s ranks wait on this torch (one line), or None: gloo's flight
    recorder dump (``torch._C._distributed_c10d._dump_fr_trace_json``) came with torch 2.8; NCCL's is older."""
    from torch._C import _distributed_c10d as c10d

    if backend == "gloo" and not hasattr(c10d, "_dump_fr_trace_json"):
        return (f"the hang watchdog reads gloo's flight recorder, which torch 2.8 added, and this is torch "
                f"{torch.__version__}; run without --watchdog, or on torch 2.8 or later")
    return None


def start_for_training(seconds: float | None, timeout_s: float, backend: str = "nccl") -> Watchdog | None:
    """``labkit train --watchdog SECONDS`` (None: ``$LABKIT_WATCHDOG``, which job scripts may export; 0: off) on
    ``backend``'s ranks."""
    from labkit.errors import ConfigError

    if seconds is None:
        text = os.environ.get("LABKIT_WATCHDOG", "0")
        try:
            seconds = float(text)
        except ValueError:
            raise ConfigError(f"LABKIT_WATCHDOG={text!r} is not a number of seconds; unset it or use e.g. "
                              "600") from None
    if seconds == 0:
        return None
    if not 0 < seconds < timeout_s:
        raise ConfigError(f"--watchdog must be 0 (off) or between 0 and --timeout-s ({timeout_s:g} s, when the "
                          f"collectives themselves give up); got {seconds:g}")
    if (why := refusal(backend)) is not None:
        raise ConfigError(why)
    return Watchdog(seconds).start()

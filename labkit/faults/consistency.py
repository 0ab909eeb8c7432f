"""``--check-collectives``: before each collective, the ranks compare what they are about to call, and the job
stops at the first disagreement with one sentence naming it and each rank's line, e.g.

    labkit: collective mismatch: rank 0 broadcasts from root 1, rank 1 from root 0 at broadcast #1 (train.py:14)
    labkit: collective mismatch: all_reduce #3: rank 0 sends float32 (100,), rank 1 float64 (100,) (train.py:20)

:func:`install` wraps every collective and point-to-point function of ``torch.distributed`` (in both its
namespaces, so the object collectives' own calls and FSDP2's ``all_gather_single`` and ``reduce_scatter_single``,
which it issues from Python, are checked too; a checked call's own inner calls, such as the ``isend`` inside
``send``, are not checked again). A wrapped call writes its signature (operation, its number on the group,
group, shape, dtype, reduce op, root or peer, the caller's file:line, the group's sequence number in the
process group) to the job's store and reads the other ranks' of the group, on a connection of its own:

* all there and equal: the collective runs. Cost: one ``multi_set``, one ``multi_get`` (the store answers
  once every key is there: a wait and a read) and one ``delete_key`` of the previous entry, four store round
  trips per collective (``benchmarks/check_collectives.py``);
* all there and different: the first argument that differs is named;
* a peer missing while it waits, in another collective or point-to-point call, for this rank (which has not
  called that one): neither can go on; a thread that looks every :data:`LOOK_S` seconds names both calls (a
  sub-group collective one rank skipped, a send with no matching recv);
* a peer missing for another reason (slow, or in a longer cycle of waits): the rank waits, and the hang
  watchdog, if started, shows the call in its table.

``isend``/``irecv`` do not wait (their peer may post its half later): the second of the two to post (an atomic
count in the store) compares them. A ``recv`` from any source is not checked. What it cannot see: the collectives a process group
issues from C++ — DDP's gradient buckets and its start-up broadcasts, a communication hook's own calls — are
counted by the process group's sequence number, so a rank that issued more of them is named at its next
checked collective (on a group that has seen no point-to-point traffic: gloo counts those in the same
number), but their arguments are not compared; nor are the split sizes of an all-to-all. The check issues no
collective and no device sync; it is off unless asked for, and then nothing is wrapped.
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labkit.faults import watchdog

#: the collectives checked: name -> (the argument whose shape and dtype every rank must agree on (None: no
#: tensor, or only the dtype of the first of a list), the root argument, whether it reduces)
COLLECTIVES = {
    "all_reduce": ("tensor", None, True), "broadcast": ("tensor", "src", False), "reduce": ("tensor", "dst", True),
    "all_gather": ("tensor", None, False), "all_gather_into_tensor": ("input_tensor", None, False),
    "all_gather_single": ("input_tensor", None, False), "reduce_scatter": ("output", None, True),
    "reduce_scatter_tensor": ("input", None, True), "reduce_scatter_single": ("input", None, True),
    "gather": ("tensor", "dst", False), "scatter": ("tensor", "src", False),
    "all_to_all_single": (None, None, False), "all_to_all": (None, None, False), "barrier": (None, None, False),
    "monitored_barrier": (None, None, False),
}
#: point-to-point: name -> its peer argument; the blocking ones wait for the peer's half
P2P = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}
_BLOCKING = ("send", "recv")
_VERBS = {"broadcast": ("broadcasts", "from"), "reduce": ("reduces", "to"), "gather": ("gathers", "to"),
          "scatter": ("scatters", "from")}
_KEY = f"labkit-check/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
LOOK_S = 0.2  # how often a rank waiting for its peers' signatures looks what they wait for
_inside = threading.local()  # whether this thread is in a checked call
_state = {"counts": {}, "previous": {}, "groups": {}, "lock": threading.Lock()}


def install() -> None:
    """Wrap the functions of :data:`COLLECTIVES` and :data:`P2P` in ``torch.distributed`` (idempotent). What
    ``torch.distributed`` holds may already be a wrapper (the watchdog's record of send/recv): it is wrapped
    in turn, and ``distributed_c10d``'s own function, which the kit's and PyTorch's modules call, beside it."""
    if not _state.get("looking"):
        _state["looking"] = threading.Thread(target=_look, name="labkit-check", daemon=True)
        _state["looking"].start()
    for name in (*COLLECTIVES, *P2P):
        original = getattr(c10d, name, None)
        if original is None or hasattr(original, "labkit_checked"):
            continue
        wrapped = _checked(name, original)
        setattr(c10d, name, wrapped)
        current = getattr(dist, name)
        setattr(dist, name, wrapped if current is original else _checked(name, current))


def _checked(name: str, fn):
    signature = inspect.signature(getattr(fn, "labkit_recorded", fn))

    def call(*args, **kwargs):
        if getattr(_inside, "call", False) or not dist.is_initialized():
            return fn(*args, **kwargs)  # a checked call's own calls (send is isend and wait) are part of it
        _inside.call = True
        try:
            sig = _signature(name, signature.bind(*args, **kwargs).arguments)
            if sig is not None:
                _agree(sig)
            return fn(*args, **kwargs)
        finally:
            _inside.call = False
    call.labkit_checked = fn
    call.__name__ = call.__qualname__ = name
    call.__doc__ = fn.__doc__
    return call


def _group(group) -> tuple[str, list[int], str, str]:
    """(name, global ranks, how a sentence names it, how the flight recorder names it) of ``group`` (None: the
    default group)."""
    group = group or c10d._get_default_group()
    known = _state["groups"].get(id(group))
    if known is None:
        ranks = dist.get_process_group_ranks(group)
        label = ("the default group" if group is c10d._get_default_group()
                 else f"group {group.group_name} (ranks {', '.join(map(str, ranks))})")
        known = _state["groups"][id(group)] = (group.group_name, ranks, label,
                                               getattr(group, "group_desc", "") or group.group_name, group)
    return known[:4]


def _tensor(value) -> tuple[list[int] | None, str]:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if not isinstance(value, torch.Tensor):
        return None, ""
    return list(value.shape), str(value.dtype).replace("torch.", "")


def _reduce_op(op) -> str:
    return str(getattr(op, "op", op)).split(".")[-1]


def caller() -> str:
    """``file.py:LINE`` of the innermost frame outside torch, the standard library and this kit's wrappers."""
    frame = sys._getframe(1)
    while frame is not None and watchdog._internal(frame.f_code.co_filename):
        frame = frame.f_back
    return "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _signature(name: str, bound: dict) -> dict | None:
    """What this rank is about to call, as the ranks compare it; None when there is nothing to compare."""
    group = bound.get("group")
    if group is not None and c10d._rank_not_in_group(group):
        return None
    gname, ranks, label, desc = _group(group)
    group, me = group or c10d._get_default_group(), dist.get_rank()
    sig = {"op": name, "group": gname, "ranks": ranks, "label": label, "desc": desc, "rank": me, "where": caller()}
    if name in P2P:
        peer = bound.get(P2P[name])
        if peer is None and bound.get(f"group_{P2P[name]}") is not None:
            peer = dist.get_global_rank(group, bound[f"group_{P2P[name]}"])
        if peer is None:
            return None  # a recv from any source: nothing to pair it with
        sig["peer"] = peer
        sig["shape"], sig["dtype"] = _tensor(bound.get("tensor"))
        return sig
    compared, root, reduces = COLLECTIVES[name]
    if compared is not None:
        sig["shape"], sig["dtype"] = _tensor(bound.get(compared))
    elif name.startswith("all_to_all"):
        sig["dtype"] = _tensor(bound.get("input") if name == "all_to_all_single" else bound.get("input_tensor_list"))[1]
    if root is not None:
        sig["root"] = bound.get(root)
        if sig["root"] is None and bound.get(f"group_{root}") is not None:
            sig["root"] = dist.get_global_rank(group, bound[f"group_{root}"])
    if reduces:
        sig["reduce_op"] = _reduce_op(bound.get("op", dist.ReduceOp.SUM))
    try:
        sig["seq"] = group._get_sequence_number_for_group()
    except (AttributeError, RuntimeError):
        pass
    return sig


def _store():
    """This process's own connection to the job's store, for the blocking reads of the main thread (the watchdog
    and :func:`_look` use the default one meanwhile); a new one when the process group is new."""
    default = c10d._get_default_store()
    if _state.get("store_of") is not default:
        _state["store"], _state["store_of"] = default.clone(), default
    return _state["store"]


def _agree(sig: dict) -> None:
    """Post ``sig`` and, for a collective or a blocking send/recv, wait until the peers agree with it."""
    store, me = _store(), sig["rank"]
    with _state["lock"]:
        if "peer" in sig:
            src, dst = (me, sig["peer"]) if sig["op"] in ("send", "isend") else (sig["peer"], me)
            slot = f"p/{sig['group']}/{src}>{dst}"
        else:
            slot = f"c/{sig['group']}"
        sig["n"] = _state["counts"][slot] = _state["counts"].get(slot, 0) + 1
        sig["p2p"] = sum(n for s, n in _state["counts"].items() if s.startswith(f"p/{sig['group']}/"))
    base = f"{_KEY}/{slot}/{sig['n']}"
    peers = [sig["peer"]] if "peer" in sig else [r for r in sig["ranks"] if r != me]
    text = json.dumps(sig)
    store.multi_set([f"{base}/{me}", f"{_KEY}/at/{me}"], [text, json.dumps({"slot": slot, **sig})])
    keys = [f"{base}/{q}" for q in peers]
    if sig["op"] in ("isend", "irecv"):  # the second of the two to arrive (an atomic count) compares them
        if store.add(f"{base}/arrived", 1) == 2:
            _compare(sig, [json.loads(store.get(keys[0]))], store)
            for key in (*keys, f"{base}/{me}", f"{base}/arrived"):
                store.delete_key(key)
        return
    watchdog.CHECKING["current"] = {"op": sig["op"], "seq": sig["seq"] + 1 if "seq" in sig else sig["n"],
                                    "shape": sig.get("shape"),
                                    "dtype": sig.get("dtype", ""), "peer": sig.get("peer"),
                                    "group": sig["desc"],
                                    "root": sig.get("root"), "reduce_op": sig.get("reduce_op"), "since": time.time()}
    _state["waiting"] = (sig, keys, peers)
    try:  # the store answers once every key is there: no polling on the way
        others = [json.loads(v) for v in store.multi_get(keys)]
    finally:
        _state["waiting"] = watchdog.CHECKING["current"] = None
    _compare(sig, others, store)
    previous = _state["previous"].get(slot)
    if previous is not None:  # every peer has posted this call, so each has read the one before
        store.delete_key(previous)
    _state["previous"][slot] = f"{base}/{me}"


def _look() -> None:
    """The check's thread: while the main thread waits for its peers' signatures, look every
    :data:`LOOK_S` seconds whether a missing peer waits for this rank in another call, and end the job if so."""
    while True:
        time.sleep(LOOK_S)
        waiting = _state.get("waiting")
        current = watchdog.CHECKING["current"]
        if waiting is None or current is None or time.time() - current["since"] < LOOK_S:
            continue
        sig, keys, peers = waiting
        try:
            store = c10d._get_default_store()
            missing = [q for q, k in zip(peers, keys) if not store.check([k])]
            blocking = _waits_for_me(sig, missing, store)
        except Exception:  # the group went away under us: the next one is looked at afresh
            continue
        if blocking is not None and _state.get("waiting") is waiting:
            _stop(crossed(sig, blocking), min(sig["rank"], blocking["rank"]), store)


def _waits_for_me(sig: dict, missing: list[int], store) -> dict | None:
    """A missing peer that waits, in a call this rank has not made yet, for this rank; None if there is none."""
    at_keys = [f"{_KEY}/at/{q}" for q in missing]
    if not store.check(at_keys):
        return None
    me = sig["rank"]
    for other in map(json.loads, store.multi_get(at_keys)):
        if other["op"] in ("isend", "irecv"):
            continue
        waits_for = [other["peer"]] if "peer" in other else other["ranks"]
        if me in waits_for and _state["counts"].get(other["slot"], 0) < other["n"]:
            return other
    return None


def describe(sig: dict) -> str:
    """``all_reduce #1 on the default group``, ``send to rank 1``."""
    if "peer" in sig:
        return f"{sig['op']} #{sig['n']} {'to' if sig['op'] in ('send', 'isend') else 'from'} rank {sig['peer']}"
    return f"{sig['op']} #{sig['n']} on {sig['label']}"


def _lines(a: dict, b: dict) -> str:
    if a["where"] == b["where"]:
        return f"({a['where']})"
    return f"(rank {a['rank']} at {a['where']}, rank {b['rank']} at {b['where']})"


def crossed(sig: dict, other: dict) -> str:
    """Two ranks each waiting for the other in a different call."""
    a, b = sorted((sig, other), key=lambda s: s["rank"])
    text = (f"rank {a['rank']} calls {describe(a)} ({a['where']}), rank {b['rank']} calls {describe(b)} "
            f"({b['where']})")
    for x, y in ((a, b), (b, a)):
        if x["op"] == "send" and not (y["op"] == "recv" and y.get("peer") == x["rank"]):
            return text + f": rank {x['rank']}'s send has no matching recv on rank {y['rank']}"
        if x["op"] == "recv" and not (y["op"] == "send" and y.get("peer") == x["rank"]):
            return text + f": rank {x['rank']}'s recv has no matching send on rank {y['rank']}"
    if a["group"] != b["group"]:
        return text + ": each waits for the other on a different group (a rank skipped a collective of one)"
    return text + ": each waits for the other in a different call (a rank-dependent branch, or uneven inputs)"


def difference(a: dict, b: dict) -> str | None:
    """One sentence on how two ranks' signatures of the same call differ; None when they agree."""
    op, where = describe(a), _lines(a, b)
    if a["op"] != b["op"]:
        return (f"rank {a['rank']} calls {describe(a)}, rank {b['rank']} calls {describe(b)} {where}: different "
                "collectives (a rank-dependent branch, or uneven inputs)")
    if a.get("root") != b.get("root"):
        verb, prep = _VERBS[a["op"]]
        return (f"rank {a['rank']} {verb} {prep} root {a['root']}, rank {b['rank']} {prep} root {b['root']} at "
                f"{op} {where}")
    if a.get("reduce_op") != b.get("reduce_op"):
        return f"{op}: rank {a['rank']} reduces with {a['reduce_op']}, rank {b['rank']} with {b['reduce_op']} {where}"
    if (a.get("dtype"), a.get("shape")) != (b.get("dtype"), b.get("shape")):
        return f"{op}: rank {a['rank']} sends {_tensor_text(a)}, rank {b['rank']} {_tensor_text(b)} {where}"
    if a.get("seq") != b.get("seq") and a.get("p2p") == b.get("p2p") == 0:
        return (f"before {op} {where}, rank {a['rank']} had issued {a['seq']} calls on the group and rank "
                f"{b['rank']} {b['seq']}: one ran collectives the check does not see (DDP's own, from C++) that the "
                "other did not")
    return None


def _tensor_text(sig: dict) -> str:
    """``float32 (100,)``."""
    return sig["dtype"] if sig.get("shape") is None else f"{sig['dtype']} {tuple(sig['shape'])}"


def p2p_difference(a: dict, b: dict) -> str | None:
    """One sentence when a send's tensor and its recv's buffer differ in dtype or shape; None when they agree."""
    a, b = sorted((a, b), key=lambda s: s["rank"])
    send, recv = (a, b) if a["op"] in ("send", "isend") else (b, a)
    if (send["dtype"], send["shape"]) == (recv["dtype"], recv["shape"]):
        return None
    return (f"{send['op']} #{send['n']} from rank {send['rank']} to rank {recv['rank']}: rank {send['rank']} sends "
            f"{_tensor_text(send)}, rank {recv['rank']} receives into {_tensor_text(recv)} {_lines(a, b)}")


def _compare(sig: dict, others: list[dict], store) -> None:
    if "peer" in sig:  # a send and its recv: the recv's buffer must take the send's tensor
        text = p2p_difference(sig, others[0])
        if text is not None:
            _stop(text, min(sig["rank"], others[0]["rank"]), store)
        return
    first = min([sig, *others], key=lambda s: s["rank"])
    for other in sorted([sig, *others], key=lambda s: s["rank"]):
        text = difference(first, other)
        if text is not None:
            _stop(text, first["rank"], store)


def _stop(sentence: str, printer: int, store) -> None:
    """End this rank with the watchdog's exit code: ``printer`` says the sentence once for the job; the others
    wait, quietly, until it has (or a few seconds)."""
    done = f"{_KEY}/done"
    if dist.get_rank() == printer:
        print(f"labkit: collective mismatch: {sentence}", file=sys.stderr, flush=True)
        watchdog._quiet()
        try:
            store.set(done, "1")
            time.sleep(0.2)  # the store may live in this rank: let the others read the key
        finally:
            os._exit(watchdog.EXIT_HUNG)
    watchdog._quiet()
    deadline = time.monotonic() + 5.0
    try:
        while time.monotonic() < deadline and not store.check([done]):
            time.sleep(0.05)
    finally:
        os._exit(watchdog.EXIT_HUNG)

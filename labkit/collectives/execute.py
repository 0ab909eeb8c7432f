"""Run a schedule for real over ``torch.distributed`` point-to-point messages (gloo on CPU, NCCL on GPU).

Each step posts all of this rank's sends and receives at once with ``dist.batch_isend_irecv`` (so no
send order can deadlock, also on NCCL), then stores or adds what arrives. Large messages travel in
segments of :data:`SEGMENT_BYTES` so additions overlap the transfer of the rest. Sends read the vector as
it was at the start of the step: nothing they read is written before they finish.

    all_reduce(grad, "ring")          # in place: grad becomes the sum over all ranks
    trace = traced_run(x, get_schedule("tree", world_size))   # + start/end/bytes of every step
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from labkit.collectives.parameter_server import parameter_server
from labkit.collectives.registry import ALGORITHMS, get_schedule
from labkit.collectives.schedule import Op, Schedule, Transfer, reduce_groups, sum_in_rank_order
from labkit.errors import ConfigError


@dataclass
class StepRecord:
    """What one rank did in one step; times in seconds from the start of the traced run."""

    rank: int
    step: int
    phase: str
    start: float
    end: float
    bytes_sent: int
    bytes_recv: int


@dataclass
class Trace:
    """Every rank's :class:`StepRecord` of one executed schedule (the animation can replay it)."""

    algorithm: str
    world_size: int
    n: int
    dtype: str
    records: list[StepRecord] = field(default_factory=list)

    def to_record(self) -> dict:
        """A ``"kind": "trace"`` record for :class:`labkit.results.RunWriter`."""
        return {"kind": "trace", "algorithm": self.algorithm, "world_size": self.world_size, "n": self.n,
                "dtype": self.dtype, "steps": [asdict(r) for r in self.records]}

    @classmethod
    def from_record(cls, record: dict) -> "Trace":
        return cls(record["algorithm"], record["world_size"], record["n"], record["dtype"],
                   [StepRecord(**r) for r in record["steps"]])

    def duration(self) -> float:
        return max((r.end for r in self.records), default=0.0)


@lru_cache(maxsize=1024)
def _plan(schedule: Schedule, rank: int):
    # Per step of this rank: (index, phase, sends, copy receives, reduce receive groups, direct, early),
    # direct: copies may land straight in the vector (they overlap no chunk sent this step);
    # early: what arrives may be applied before our own sends finish (no written chunk is being sent).
    plan = []
    for i, step in enumerate(schedule.steps):
        sends = tuple(t for t in step.transfers if t.src == rank)
        incoming = [t for t in step.transfers if t.dst == rank]
        copies = tuple(t for t in incoming if t.op is Op.COPY)
        groups = tuple(tuple(g) for g in reduce_groups(incoming).values())
        direct = not any(_overlap(c, s) for c in copies for s in sends)
        early = not any(_overlap(t, s) for t in incoming for s in sends)
        plan.append((i, step.phase, sends, copies, groups, direct, early))
    return tuple(plan)


def _overlap(a: Transfer, b: Transfer) -> bool:
    return a.start < b.stop and b.start < a.stop


_WORKSPACE: dict = {}


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    # Receive buffers are reused across steps and calls: fresh large buffers cost page faults every time.
    key = (like.dtype, like.device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACE[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf


_READY: set = set()


def _first_call(group) -> None:
    # NCCL requires every rank of a group to join its first batched point-to-point call; a barrier
    # as the group's first collective makes any later subset of pairs safe.
    key = id(dist.group.WORLD if group is None else group)
    if key not in _READY:
        dist.barrier(group=group)
        _READY.add(key)


#: Messages above this size travel as several segments, so additions start while the rest still arrives.
SEGMENT_BYTES = 1 << 20


def _segments(view: torch.Tensor, seg: int) -> list[torch.Tensor]:
    return [view[i:i + seg] for i in range(0, view.numel(), seg)]  # none for an empty chunk: both sides skip


def _run_step(flat: torch.Tensor, bounds, entry, rank: int, peer, group) -> tuple[int, int]:
    """One step on this rank: post every receive and send at once, store or add what arrives.

    Returns the elements sent and received.
    """
    _, _, sends, copies, groups, direct, early = entry

    def piece(t: Transfer) -> torch.Tensor:
        return flat[bounds[t.start][0]:bounds[t.stop - 1][1]]

    seg = max(1, SEGMENT_BYTES // flat.element_size())
    staged = [t for g in groups for t in g] + ([] if direct else list(copies))
    space = _workspace(sum(piece(t).numel() for t in staged), flat)
    received, offset = {}, 0
    for t in staged:
        received[t.src] = space[offset:offset + piece(t).numel()]
        offset += piece(t).numel()
    # Each receive segment with what to do once it is in: add it (single-sender reduce) or nothing yet.
    recvs: list[tuple[dist.P2POp, tuple | None]] = []
    for t in copies if direct else ():
        recvs += [(dist.P2POp(dist.irecv, s, peer(t.src), group), None) for s in _segments(piece(t), seg)]
    for senders in groups:
        for t in senders:
            pairs = zip(_segments(received[t.src], seg), _segments(piece(t), seg))
            recvs += [(dist.P2POp(dist.irecv, buf, peer(t.src), group), (own, buf) if len(senders) == 1 else None)
                      for buf, own in pairs]
    for t in copies if not direct else ():
        recvs += [(dist.P2POp(dist.irecv, s, peer(t.src), group), None) for s in _segments(received[t.src], seg)]
    sends_ops = [dist.P2POp(dist.isend, s, peer(t.dst), group) for t in sends for s in _segments(piece(t), seg)]
    ops = [op for op, _ in recvs] + sends_ops
    requests = dist.batch_isend_irecv(ops) if ops else []
    # gloo returns one request per op; NCCL may return one for the whole batch (its wait() then orders
    # the GPU stream, so adding afterwards is safe).
    early = early and len(requests) == len(ops)
    # A gloo request must be waited on exactly once. Receives first, so additions overlap our own sends,
    # unless we add into chunks we are still sending: then everything completes before anything is written.
    if early:
        for request, (_, action) in zip(requests, recvs):
            request.wait()
            if action is not None:
                action[0].add_(action[1])
    else:
        for request in requests:
            request.wait()
        for _, action in recvs:
            if action is not None:
                action[0].add_(action[1])
    if not direct:
        for t in copies:
            piece(t).copy_(received[t.src])
    for senders in groups:
        if len(senders) > 1 and piece(senders[0]).numel():
            own = piece(senders[0])
            own.copy_(sum_in_rank_order([(rank, own)] + [(t.src, received[t.src]) for t in senders]))
    for request in requests[len(recvs):] if early else ():
        request.wait()
    return sum(op.tensor.numel() for op in sends_ops), sum(op.tensor.numel() for op, _ in recvs)


def run_schedule(tensor: torch.Tensor, schedule: Schedule, group=None, trace: list | None = None,
                 steps: range | None = None, clock_zero: float | None = None) -> torch.Tensor:
    """Execute ``schedule`` on this rank's ``tensor`` (any shape, flattened), in place.

    Args:
        tensor: this rank's input; afterwards the sum over the contributing ranks.
        schedule: a schedule for exactly the group's world size.
        group: process group (default: the world).
        trace: if a list, one :class:`StepRecord` per step this rank takes part in is appended.
        steps: run only these step indices (0-based), e.g. the push of a parameter server.
        clock_zero: ``time.perf_counter()`` value the trace times are measured from.

    Raises:
        ConfigError: the world size does not match the schedule, or the tensor is empty.
    """
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    if p != schedule.world_size:
        raise ConfigError(f"the {schedule.algorithm} schedule is for {schedule.world_size} ranks but the "
                          f"process group has {p}; build it with get_schedule(name, {p})")
    if tensor.numel() == 0:
        raise ConfigError(f"cannot all-reduce an empty tensor (shape {tuple(tensor.shape)})")
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    bounds = schedule.chunk_bounds(flat.numel())
    steps = range(schedule.num_steps) if steps is None else steps
    if rank in schedule.servers and steps.start == 0:
        flat.zero_()
    _first_call(group)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    zero = time.perf_counter() if clock_zero is None else clock_zero
    for entry in _plan(schedule, rank):
        index, phase, sends, copies, groups = entry[:5]
        if index not in steps or not (sends or copies or groups):
            continue
        start = time.perf_counter()
        sent, got = _run_step(flat, bounds, entry, rank, peer, group)
        if trace is not None:
            if flat.is_cuda:
                torch.cuda.synchronize(flat.device)
            trace.append(StepRecord(rank, index + 1, phase, start - zero, time.perf_counter() - zero,
                                    sent * flat.element_size(), got * flat.element_size()))
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def all_reduce(tensor: torch.Tensor, algorithm: str = "ring", group=None) -> torch.Tensor:
    """Sum ``tensor`` in place over all ranks of ``group`` with the named algorithm's schedule.

    Args:
        tensor: this rank's tensor, any shape; every rank passes the same shape and dtype.
        algorithm: one of :data:`ALGORITHMS`, or ``"native"`` for ``dist.all_reduce``.
        group: process group (default: the world).

    Returns:
        ``tensor``, now holding the element-wise sum (bit-identical on every rank).
    """
    if algorithm == "native":
        dist.all_reduce(tensor, group=group)
        return tensor
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown all-reduce algorithm {algorithm!r}; choose from "
                          f"{', '.join(ALGORITHMS + ('native',))}")
    if tensor.numel() == 0:
        raise ConfigError(f"cannot all-reduce an empty tensor (shape {tuple(tensor.shape)})")
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    return run_schedule(tensor, get_schedule(algorithm, world_size), group=group)


def push_pull(tensor: torch.Tensor, num_servers: int = 1, group=None) -> torch.Tensor:
    """Run :func:`labkit.collectives.parameter_server.parameter_server` over the default process group, in place.

    On a worker ``tensor`` is its gradient and becomes the sum over all workers. On a server it is the
    buffer of its shard: it is zeroed, and afterwards its chunk ``s`` holds that shard's sum.
    """
    schedule = parameter_server(dist.get_world_size(group), num_servers)
    run_schedule(tensor, schedule, group=group)
    return tensor


def sgd_step(param: torch.Tensor, grad: torch.Tensor, lr: float, num_servers: int = 1, group=None) -> torch.Tensor:
    """One synchronous parameter-server SGD step on flat vectors, in place on ``param``.

    Workers push ``grad``; server ``s`` updates its shard ``param_s <- param_s - lr * sum_w(grad_w)_s / W``;
    workers pull the updated shard into ``param``. Servers keep the authoritative parameters, so workers'
    ``param`` values before the step are ignored (they are overwritten by the pull).

    Args:
        param: ``(n,)`` parameters (on servers: the parameters; on workers: overwritten).
        grad: ``(n,)`` gradient of this worker (ignored on servers).
        lr: learning rate.
    """
    p = dist.get_world_size(group)
    rank = dist.get_rank(group)
    schedule = parameter_server(p, num_servers)
    bounds = schedule.chunk_bounds(param.numel())
    buf = grad.detach().clone().reshape(-1)
    run_schedule(buf, schedule, group=group, steps=range(0, 1))  # push
    if rank in schedule.servers:
        a, b = bounds[rank]
        param.view(-1)[a:b].sub_(buf[a:b], alpha=lr / (p - num_servers))
    run_schedule(param.view(-1), schedule, group=group, steps=range(1, 2))  # pull
    return param


def traced_run(tensor: torch.Tensor, schedule: Schedule, group=None) -> Trace:
    """Run ``schedule`` in place and return every rank's step timings (gathered on all ranks).

    A barrier first lines the ranks up, so times (seconds from leaving it) are comparable across ranks.
    """
    dist.barrier(group=group)
    zero = time.perf_counter()
    mine: list[StepRecord] = []
    run_schedule(tensor, schedule, group=group, trace=mine, clock_zero=zero)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    records = sorted((r for rank_records in everyone for r in rank_records), key=lambda r: (r.step, r.rank))
    return Trace(schedule.algorithm, schedule.world_size, tensor.numel(), str(tensor.dtype).replace("torch.", ""),
                 records)

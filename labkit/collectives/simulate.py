"""Run a schedule in one process: on real per-rank vectors, on "whose data is in here" sets, and as counts.

* :func:`simulate` applies the schedule to ``p`` vectors and checks every rank ends with the sum.
* :func:`coverage` tracks, for every rank and chunk, the set of ranks whose input it already contains
  (what the animation colours) and raises :class:`ScheduleError` the moment data would be added twice.
* :func:`count` gives steps, messages and elements per rank and per step (what the cost model prices).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.collectives.schedule import Op, Schedule, ScheduleError, reduce_groups, sum_in_rank_order

Coverage = list[list[frozenset[int]]]  # [rank][chunk] -> ranks whose input the chunk contains


@dataclass
class StepCounts:
    """The busiest rank of one step: most messages and elements in one direction, most elements added."""

    messages: int
    elements: int
    reduced: int


@dataclass
class Counts:
    """Traffic of a schedule on length-``n`` vectors. Lists are indexed by rank."""

    n: int
    steps: int
    messages_sent: list[int]
    messages_recv: list[int]
    elements_sent: list[int]
    elements_recv: list[int]
    per_step: list[StepCounts] = field(default_factory=list)

    @property
    def total_messages(self) -> int:
        return sum(self.messages_sent)

    def bytes_sent(self, itemsize: int = 4) -> list[int]:
        """Bytes each rank sends, for elements of ``itemsize`` bytes."""
        return [e * itemsize for e in self.elements_sent]

    def bytes_recv(self, itemsize: int = 4) -> list[int]:
        """Bytes each rank receives, for elements of ``itemsize`` bytes."""
        return [e * itemsize for e in self.elements_recv]

    @property
    def total_elements(self) -> int:
        return sum(self.elements_sent)


@dataclass
class SimResult:
    """Outputs per rank, the coverage after every step (index 0 = start) and the counts."""

    outputs: list[torch.Tensor]
    coverage: list[Coverage]
    counts: Counts


def count(schedule: Schedule, n: int) -> Counts:
    """Messages and elements each rank sends and receives, in total and for the busiest rank per step.

    ``schedule`` must be valid (:func:`labkit.collectives.get_schedule` validates; else call ``.validate()``).
    """
    bounds = schedule.chunk_bounds(n)
    p = schedule.world_size
    counts = Counts(n, schedule.num_steps, [0] * p, [0] * p, [0] * p, [0] * p)
    for step in schedule.steps:
        ms, mr, es, er, red = ([0] * p for _ in range(5))
        for t in step.transfers:
            a, b = schedule.slice_of(t, bounds)
            ms[t.src] += 1
            mr[t.dst] += 1
            es[t.src] += b - a
            er[t.dst] += b - a
            if t.op is Op.REDUCE:
                red[t.dst] += b - a
        for r in range(p):
            counts.messages_sent[r] += ms[r]
            counts.messages_recv[r] += mr[r]
            counts.elements_sent[r] += es[r]
            counts.elements_recv[r] += er[r]
        counts.per_step.append(StepCounts(max(max(ms), max(mr)), max(max(es), max(er)), max(red)))
    return counts


def _names(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def coverage(schedule: Schedule, check: bool = True) -> list[Coverage]:
    """Whose data every chunk of every rank contains, at the start and after each step.

    Args:
        schedule: the schedule to follow.
        check: raise :class:`ScheduleError` if data would be added twice or, at the end, a rank that
            should hold the sum misses a contribution.

    Returns:
        ``frames[s][rank][chunk]``: a frozenset of ranks, ``s = 0 .. num_steps``.
    """
    schedule.validate()
    p, k = schedule.world_size, schedule.num_chunks
    state = [[frozenset() if r in schedule.servers else frozenset({r}) for _ in range(k)] for r in range(p)]
    frames = [state]
    for i, step in enumerate(schedule.steps, 1):
        new = [list(chunks) for chunks in state]
        for t in step.transfers:
            if t.op is Op.COPY:
                for c in t.chunks:
                    new[t.dst][c] = state[t.src][c]
        for dst in range(p):
            groups = reduce_groups(t for t in step.transfers if t.dst == dst)
            for (start, stop), senders in groups.items():
                for c in range(start, stop):
                    held = state[dst][c]
                    for t in senders:
                        twice = held & state[t.src][c]
                        if check and twice:
                            raise ScheduleError(
                                f"{step.name(i)}: rank {dst} adds chunk {c} from rank {t.src}, but "
                                f"both already contain data of rank(s) {_names(twice)}: it would be counted twice")
                        held = held | state[t.src][c]
                    new[dst][c] = held
        state = [list(chunks) for chunks in new]
        frames.append(state)
    if check:
        _check_complete(schedule, state)
    return frames


def _check_complete(schedule: Schedule, final: Coverage) -> None:
    want = frozenset(schedule.contributors)
    for r in schedule.contributors:
        for c, held in enumerate(final[r]):
            if held != want:
                raise ScheduleError(f"after the last step rank {r} chunk {c} holds data of rank(s) "
                                    f"{_names(held) or 'none'}; missing rank(s) {_names(want - held)}")


def _apply_step(schedule: Schedule, step, bufs: list[torch.Tensor], bounds) -> None:
    sent = {(t.src, t.dst): bufs[t.src][slice(*schedule.slice_of(t, bounds))].clone() for t in step.transfers}
    for t in step.transfers:
        if t.op is Op.COPY:
            a, b = schedule.slice_of(t, bounds)
            bufs[t.dst][a:b] = sent[(t.src, t.dst)]
    for dst in range(schedule.world_size):
        for senders in reduce_groups(t for t in step.transfers if t.dst == dst).values():
            a, b = schedule.slice_of(senders[0], bounds)
            own = bufs[dst][a:b]
            if len(senders) == 1:
                own.add_(sent[(senders[0].src, dst)])
            else:
                own.copy_(sum_in_rank_order([(dst, own)] + [(t.src, sent[(t.src, dst)]) for t in senders]))


def simulate(schedule: Schedule, inputs: list[torch.Tensor] | None = None, n: int = 12,
             check: bool = True) -> SimResult:
    """Apply a schedule to one 1-D vector per rank.

    Args:
        schedule: the schedule.
        inputs: ``p`` tensors of shape ``(n,)``; default: rank ``r`` holds ``arange(n) + 1000 r`` (float64).
            Server ranks' inputs are ignored (their buffers start at zero).
        n: vector length when ``inputs`` is None.
        check: raise :class:`ScheduleError` if a rule is broken or a rank does not end with the sum.

    Returns:
        A :class:`SimResult`; ``outputs[r]`` is rank ``r``'s vector after the last step.
    """
    p = schedule.world_size
    if inputs is None:
        inputs = [torch.arange(n, dtype=torch.float64) + 1000.0 * r for r in range(p)]
    if len(inputs) != p:
        raise ScheduleError(f"the schedule has {p} ranks but {len(inputs)} inputs were given")
    n = inputs[0].numel()
    if any(x.dim() != 1 or x.numel() != n for x in inputs):
        shapes = [tuple(x.shape) for x in inputs]
        raise ScheduleError(f"inputs must be 1-D vectors of equal length, got shapes {shapes}")
    frames = coverage(schedule, check=check)
    counts = count(schedule, n)
    bounds = schedule.chunk_bounds(n)
    bufs = [torch.zeros_like(x) if r in schedule.servers else x.clone() for r, x in enumerate(inputs)]
    for step in schedule.steps:
        _apply_step(schedule, step, bufs, bounds)
    if check:
        want = sum(inputs[r] for r in schedule.contributors)
        for r in schedule.contributors:
            if not torch.allclose(bufs[r], want):
                raise ScheduleError(f"rank {r} ends with {bufs[r].tolist()}, expected the sum {want.tolist()}")
    return SimResult(bufs, frames, counts)

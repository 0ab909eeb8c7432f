"""Run a pipeline schedule (:class:`labkit.parallel.pp_schedule.PipeSchedule`) on paper: the ideal Gantt from
per-action costs, the idle time counted, the peak of activations in flight, and the first action that breaks.

    result = simulate(pipe_schedule("1f1b", 4, 8))          # unit costs t_F = t_B = t_W = 1
    result.makespan, result.idle, result.bubble, result.peak  # 33, [9, 9, 9, 9], 3/11, [4, 3, 2, 1]

Each rank runs its list in order; an action starts when its rank is free and its inputs exist:

* ``F`` of stage ``s > 0`` after ``F`` of stage ``s − 1`` (same micro-batch), plus ``comm`` if they are on two ranks;
* ``B``/``BW`` of stage ``s`` after its own ``F`` and, below the last stage, after ``B``/``BW`` of stage ``s + 1``
  (plus ``comm`` across ranks);
* ``W`` after its ``B``, on the same rank, earlier in the list.

Costs are per whole stage (``t_F``, ``t_B``, ``t_W``, as in the zero-bubble paper); a chunk of ``v`` per rank costs
``1/v`` of them and ``BW`` costs ``t_B + t_W``. A cost may also be a list, one per stage (``S = p·v`` of them, each
already a chunk's), for stages that are not equal (the advisor's price). Arithmetic on integers and fractions is
exact (:class:`fractions.Fraction`), so idle time is a count, compared with the formulas with ``==``; floats stay
floats. The peak in flight is the most micro-batch chunks whose forward
ran and whose weight gradient has not (their saved activations), per rank.

:func:`check` (the ``labkit check pp-schedule`` exercise) names the first broken rule: an action on a stage its
rank does not hold, a duplicated or missing action, a ``W`` before its ``B``, a receive whose send never comes
(the deadlock: every rank waits).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fractions import Fraction

from labkit.errors import ConfigError
from labkit.parallel.pp_schedule import FORWARD, FULL, INPUT, WEIGHT, Action, PipeSchedule


class PipelineScheduleError(ConfigError):
    """A schedule breaks a rule or deadlocks; the message names the action."""


@dataclass
class SimResult:
    """The simulated step: ``spans[r]`` = ``[(action, start, end)]``, ``makespan``, per rank ``busy``, ``idle``
    (makespan − busy), ``peak`` (activations in flight, chunk-micro-batches) and the ``bubble`` fraction."""

    schedule: PipeSchedule
    spans: list[list[tuple[Action, Fraction, Fraction]]]
    makespan: Fraction
    busy: list[Fraction]
    peak: list[int] = field(default_factory=list)

    @property
    def idle(self) -> list[Fraction]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> Fraction:
        """Idle share of all ranks' time: ``Σ idle / (p · makespan)``."""
        return sum(self.idle, 0) / (len(self.busy) * self.makespan)


def _exact(x):
    return x if isinstance(x, float) else Fraction(x)


def _per_stage(t, stages: int, v: int) -> list:
    """One cost per stage: a list as given, a number divided among a rank's ``v`` chunks."""
    if isinstance(t, (list, tuple)):
        if len(t) != stages:
            raise ConfigError(f"{len(t)} stage costs for {stages} stages; give one per stage")
        return [_exact(x) for x in t]
    return [_exact(t) / v] * stages


def _costs(t_f, t_b, t_w, s: PipeSchedule) -> dict[str, list]:
    t_f, t_b, t_w = (_per_stage(t, s.num_stages, s.chunks) for t in (t_f, t_b, t_w))
    return {FORWARD: t_f, INPUT: t_b, WEIGHT: t_w, FULL: [b + w for b, w in zip(t_b, t_w)]}


def check_rules(s: PipeSchedule) -> None:
    """Every (stage, micro-batch) has one F and either one BW or one B and one W, each on the rank that holds the
    stage; a W comes after its B in that rank's list. Raises :class:`PipelineScheduleError` naming the action."""
    if len(s.actions) != s.ranks:
        raise PipelineScheduleError(f"{len(s.actions)} action lists for {s.ranks} ranks; give one list per rank")
    seen: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind not in (FORWARD, INPUT, WEIGHT, FULL):
                raise PipelineScheduleError(f"rank {r}, action {i + 1}: kind {a.kind!r}; use F, B, W or BW")
            if not (0 <= a.stage < s.num_stages and 0 <= a.mb < s.microbatches):
                raise PipelineScheduleError(f"rank {r}, action {i + 1} {a}: stage must be in 0..{s.num_stages - 1}"
                                            f" and micro-batch in 0..{s.microbatches - 1}")
            if s.rank_of(a.stage) != r:
                raise PipelineScheduleError(f"rank {r}, action {i + 1} {a}: stage {a.stage} lives on rank "
                                            f"{s.rank_of(a.stage)}, not on rank {r}")
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise PipelineScheduleError(f"rank {r}: {a} appears twice (actions {seen[key] + 1} and {i + 1})")
            seen[key] = i
            if a.kind == WEIGHT and (INPUT, a.stage, a.mb) not in seen:
                raise PipelineScheduleError(f"rank {r}, action {i + 1} {a}: W before its B "
                                            f"(B{a.stage}.{a.mb} must come earlier in rank {r}'s list)")
            if a.kind in (INPUT, FULL) and (FORWARD, a.stage, a.mb) not in seen:
                raise PipelineScheduleError(f"rank {r}, action {i + 1} {a}: backward before its forward "
                                            f"F{a.stage}.{a.mb}")
    for stage in range(s.num_stages):
        for mb in range(s.microbatches):
            r = s.rank_of(stage)
            if (FORWARD, stage, mb) not in seen:
                raise PipelineScheduleError(f"rank {r}: F{stage}.{mb} is missing")
            split, full = (INPUT, stage, mb) in seen, (FULL, stage, mb) in seen
            if split == full:
                raise PipelineScheduleError(f"rank {r}: micro-batch {mb} of stage {stage} needs either BW{stage}."
                                            f"{mb} or B{stage}.{mb} with W{stage}.{mb}" +
                                            (", not both" if split else ""))
            if split and (WEIGHT, stage, mb) not in seen:
                raise PipelineScheduleError(f"rank {r}: W{stage}.{mb} is missing (B{stage}.{mb} has no W)")


def _needs(s: PipeSchedule, a: Action) -> list[Action | tuple]:
    """The actions ``a`` waits for on other stages (its own-rank order is the list's)."""
    last = s.num_stages - 1
    if a.kind == FORWARD:
        return [(FORWARD, a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind in (INPUT, FULL):
        deps = [(FORWARD, a.stage, a.mb)]
        if a.stage < last:
            deps.append(("grad", a.stage + 1, a.mb))
        return deps
    return [(INPUT, a.stage, a.mb)]


@dataclass(frozen=True)
class _Order:
    """A schedule compiled once: every action in an order that respects its dependencies, each with its rank,
    the positions of the actions it waits for on other stages, and the peak in flight per rank (cost-free)."""

    actions: tuple[tuple[int, Action, tuple[int, ...]], ...]   # (rank, action, dependencies' positions)
    peak: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _compile(s: PipeSchedule) -> _Order:
    """Sweep the ranks, taking each rank's next action as soon as what it waits for has been taken: the order in
    which a run could start them. Raises :class:`PipelineScheduleError` on a broken rule or a deadlock, naming the
    first action of every rank that waits."""
    check_rules(s)
    position: dict[tuple, int] = {}   # (kind, stage, mb) -> position in the order; ("grad", ...) for B or BW
    order: list[tuple[int, Action, tuple[int, ...]]] = []
    nxt = [0] * s.ranks
    in_flight, peak = [0] * s.ranks, [0] * s.ranks
    progress = True
    while progress:
        progress = False
        for r in range(s.ranks):
            while nxt[r] < len(s.actions[r]):
                a = s.actions[r][nxt[r]]
                deps = _needs(s, a)
                if any(d not in position for d in deps):
                    break
                position[(a.kind, a.stage, a.mb)] = len(order)
                if a.kind in (INPUT, FULL):
                    position[("grad", a.stage, a.mb)] = len(order)
                order.append((r, a, tuple(position[d] for d in deps)))
                in_flight[r] += 1 if a.kind == FORWARD else -1 if a.kind in (WEIGHT, FULL) else 0
                peak[r] = max(peak[r], in_flight[r])
                nxt[r] += 1
                progress = True
    if any(nxt[r] < len(s.actions[r]) for r in range(s.ranks)):
        waits = []
        for r in range(s.ranks):
            if nxt[r] < len(s.actions[r]):
                a = s.actions[r][nxt[r]]
                missing = next(d for d in _needs(s, a) if d not in position)
                what = (f"the gradient from stage {missing[1]}" if missing[0] == "grad"
                        else f"{missing[0]}{missing[1]}.{missing[2]}")
                waits.append(f"rank {r} at {a} (action {nxt[r] + 1}) waits for {what}")
        raise PipelineScheduleError("deadlock: " + "; ".join(waits))
    return _Order(tuple(order), tuple(peak))


def simulate(s: PipeSchedule, t_f=1, t_b=1, t_w=1, comm=0) -> SimResult:
    """The ideal Gantt of ``s`` (module docstring): each action starts when its rank is free and the actions it
    waits for have ended (plus ``comm`` from another rank). Raises :class:`PipelineScheduleError` on a broken rule or
    a deadlock, naming the first action of every rank that waits."""
    compiled = _compile(s)
    cost = _costs(t_f, t_b, t_w, s)
    comm = _exact(comm)
    zero = 0.0 if isinstance(comm, float) else Fraction(0)
    free = [zero] * s.ranks
    ends: list = []
    ranks: list[int] = []
    spans: list[list] = [[] for _ in range(s.ranks)]
    for r, a, deps in compiled.actions:
        start = free[r]
        for d in deps:
            ready = ends[d] + (comm if ranks[d] != r else 0)
            if ready > start:
                start = ready
        end = start + cost[a.kind][a.stage]
        spans[r].append((a, start, end))
        free[r] = end
        ends.append(end)
        ranks.append(r)
    makespan = max(free)
    busy = [sum((e - b for _, b, e in spans[r]), 0) for r in range(s.ranks)]
    return SimResult(s, spans, makespan, busy, list(compiled.peak))


def step_time(s: PipeSchedule, t_f=1, t_b=1, t_w=1, comm=0):
    """The makespan alone of :func:`simulate` (the same pass over the same compiled order, without the Gantt): what
    the advisor's price reads thousands of times in a search."""
    compiled = _compile(s)
    cost = _costs(t_f, t_b, t_w, s)
    comm = _exact(comm)
    free = [0] * s.ranks
    ends, ranks = [], []
    for r, a, deps in compiled.actions:
        start = free[r]
        for d in deps:
            ready = ends[d] + comm if ranks[d] != r else ends[d]
            if ready > start:
                start = ready
        free[r] = start + cost[a.kind][a.stage]
        ends.append(free[r])
        ranks.append(r)
    return max(free)


def peak_in_flight(s: PipeSchedule) -> list[int]:
    """Per rank, the most micro-batch chunks whose forward ran and whose weight gradient has not (costs play no
    part: the order on the rank decides it)."""
    return list(_compile(s).peak)


@functools.lru_cache(maxsize=512)
def unit_step(name: str, ranks: int, microbatches: int, chunks: int = 1) -> tuple[Fraction, Fraction]:
    """``(idle, peak)`` of the named schedule at ``t_F = t_B = t_W`` (a step's FLOPs split 2 : 2 : 2, the forward's
    matrix products, the input gradient's and the weight gradient's), both relative to the work of one micro-batch:
    ``idle`` = one rank's idle time / (``t_F + t_B + t_W``), ``peak`` = the fullest rank's activations in flight in
    whole-stage micro-batches (chunks / v). The advisor's bubble is ``idle / m`` of the compute and its activations
    ``peak`` micro-batches' worth (:func:`labkit.parallel.pricing.price_mesh`): the one object, simulated once."""
    from labkit.parallel.pp_schedule import pipe_schedule

    result = simulate(pipe_schedule(name, ranks, microbatches, chunks))
    return max(result.idle) / 3, Fraction(max(result.peak), chunks)


def check(s: PipeSchedule, **costs) -> SimResult:
    """:func:`simulate`, for a schedule a learner wrote (the same errors, one line each)."""
    return simulate(s, **costs)

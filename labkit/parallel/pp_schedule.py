"""Pipeline schedules as data: every rank's compute actions in order, made by one small generator per schedule.

    s = pipe_schedule("zb-h1", ranks=4, microbatches=8)
    s.actions[0][:6]   # (F0.0, F0.1, F0.2, F0.3, B0.0, W0.0): kind, stage . micro-batch
    simulate(s)        # labkit.parallel.pp_simulate: the ideal Gantt, idle slots, peak in-flight activations

A model is cut into ``S = p·v`` stages (``v`` chunks per rank). An :class:`Action` is one compute step of one
micro-batch on one stage:

* ``F``: forward; ``BW``: the whole backward (input and weight gradients at once);
* ``B``: the input gradient only (what the previous stage waits for); ``W``: the weight gradients, any time after
  its ``B`` on the same rank (what fills the bubbles: Qi et al., "Zero Bubble Pipeline Parallelism").

Sends and receives follow from the placement and are not listed by hand: an ``F`` of stage ``s > 0`` receives the
activation of ``F(s-1)``, a ``B``/``BW`` of stage ``s < S-1`` receives the gradient of ``B(s+1)``; the message
crosses ranks when the two stages live on different ranks (:meth:`PipeSchedule.with_comms` lists them). Placement is
``loop`` (stage ``s`` on rank ``s mod p``: GPipe, 1F1B, interleaved) or ``v`` (rank ``r`` holds stages ``r`` and
``2p-1-r``: ZBV, DualPipeV, whose turn at the last rank stays on that rank).

The one object feeds the executor on the ``pp`` dimension (:mod:`labkit.parallel.pp_runtime`), the simulator
(:mod:`labkit.parallel.pp_simulate`), the animation (:mod:`labkit.viz.pipeline`) and the advisor's price
(:func:`labkit.parallel.pipelining.price_pipeline`). Each generator's docstring gives its bubble and its peak
in-flight activations, with whole-stage costs ``t_F, t_B, t_W`` (a chunk costs ``1/v`` of them); the simulator's
counted idle time equals them exactly (``tests/test_pp_schedule.py``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from labkit.errors import ConfigError

FORWARD, INPUT, WEIGHT, FULL = "F", "B", "W", "BW"
KINDS = (FORWARD, INPUT, WEIGHT, FULL)


@dataclass(frozen=True, order=True)
class Action:
    """One compute step: ``kind`` (F, B, W or BW) of micro-batch ``mb`` on stage ``stage``."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"

    __repr__ = __str__


@dataclass(frozen=True)
class PipeSchedule:
    """A pipeline schedule as data.

    Attributes:
        name: e.g. ``"zb-h1"``.
        ranks: ``p``, ranks in the pipeline.
        microbatches: ``m``.
        chunks: ``v``, stages per rank (``S = p·v`` stages in all).
        placement: ``"loop"`` (stage ``s`` on rank ``s mod p``) or ``"v"`` (rank ``r``: stages ``r`` and ``2p-1-r``).
        actions: per rank, its compute actions in order.
        split_backward: does the schedule run ``B`` and ``W`` apart (True) or ``BW`` (False)?
    """

    name: str
    ranks: int
    microbatches: int
    chunks: int
    placement: str
    actions: tuple[tuple[Action, ...], ...]

    def __hash__(self) -> int:  # cheap (the simulator caches by schedule); equal schedules still compare in full
        return hash((self.name, self.ranks, self.microbatches, self.chunks, self.placement,
                     tuple(len(a) for a in self.actions)))

    @property
    def num_stages(self) -> int:
        return self.ranks * self.chunks

    @property
    def split_backward(self) -> bool:
        return any(a.kind == WEIGHT for acts in self.actions for a in acts)

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        if self.placement == "v":
            return stage if stage < self.ranks else 2 * self.ranks - 1 - stage
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in the model's order."""
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def with_comms(self, rank: int) -> list[tuple[str, object]]:
        """``rank``'s list with its messages: ``("recv", (kind, stage, mb, peer))`` before the action that needs it,
        ``("send", ...)`` after the one that makes it, ``("compute", Action)`` between. ``kind`` is ``"act"``
        (forward activation) or ``"grad"`` (input gradient); messages between stages of one rank are not listed."""
        out: list[tuple[str, object]] = []
        last = self.num_stages - 1
        for a in self.actions[rank]:
            if a.kind == FORWARD and a.stage > 0 and self.rank_of(a.stage - 1) != rank:
                out.append(("recv", ("act", a.stage, a.mb, self.rank_of(a.stage - 1))))
            if a.kind in (INPUT, FULL) and a.stage < last and self.rank_of(a.stage + 1) != rank:
                out.append(("recv", ("grad", a.stage, a.mb, self.rank_of(a.stage + 1))))
            out.append(("compute", a))
            if a.kind == FORWARD and a.stage < last and self.rank_of(a.stage + 1) != rank:
                out.append(("send", ("act", a.stage + 1, a.mb, self.rank_of(a.stage + 1))))
            if a.kind in (INPUT, FULL) and a.stage > 0 and self.rank_of(a.stage - 1) != rank:
                out.append(("send", ("grad", a.stage - 1, a.mb, self.rank_of(a.stage - 1))))
        return out

    def messages(self) -> int:
        """Point-to-point messages per step over all ranks (each activation and gradient that crosses ranks)."""
        return sum(kind == "send" for r in range(self.ranks) for kind, _ in self.with_comms(r))

    def describe(self, rank: int) -> str:
        return " ".join(map(str, self.actions[rank]))


def _f(stage, mb):
    return Action(FORWARD, stage, mb)


def gpipe(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """GPipe (fill-drain): every forward, then every backward, in micro-batch order.

    Bubble per rank ``(p − 1)(t_F + t_B + t_W)``; peak in-flight activations ``m`` micro-batches on every rank.
    """
    return [[_f(r, j) for j in range(m)] + [Action(FULL, r, j) for j in range(m)] for r in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-flush): rank ``r`` runs ``p − r`` forwards, then alternates one backward, one forward; the
    last ``p − r`` backwards drain. Needs ``m ≥ p``.

    Bubble per rank ``(p − 1)(t_F + t_B + t_W)`` (GPipe's); peak in-flight activations ``p − r`` on rank ``r``
    (``p`` on rank 0).
    """
    out = []
    for r in range(p):
        warm = min(p - r, m)
        acts = [_f(r, j) for j in range(warm)]
        for j in range(m):
            acts.append(Action(FULL, r, j))
            if warm + j < m:
                acts.append(_f(r, warm + j))
        out.append(acts)
    return out


def interleaved_1f1b(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): rank ``r`` holds ``v`` chunks, stages
    ``r, r + p, …``. Forwards go ``p`` micro-batches per chunk, chunk after chunk (the ``k``-th forward is chunk
    ``(k // p) mod v``, micro-batch ``(k // pv)·p + k mod p``); backwards the same with the chunks reversed. Warm-up
    ``(v − 1)p + 2(p − 1 − r)`` forwards, then one forward, one backward. Needs ``m`` a multiple of ``p``.

    Bubble per rank ``(p − 1)(t_F + t_B + t_W) / v``; peak in-flight activations on rank 0
    ``(v − 1)p + 2(p − 1) + 1`` chunk-micro-batches, i.e. ``p(1 + (p − 1)/(pv))`` stage-micro-batches' worth.
    """
    out, total = [], m * v
    for r in range(p):
        def stage(k, backward=False):
            chunk = (k // p) % v
            return ((v - 1 - chunk) if backward else chunk) * p + r

        def mb(k):
            return (k // (p * v)) * p + k % p
        warm = min((v - 1) * p + 2 * (p - 1 - r), total)
        acts = [_f(stage(k), mb(k)) for k in range(warm)]
        for k in range(total - warm):
            acts.append(_f(stage(warm + k), mb(warm + k)))
            acts.append(Action(FULL, stage(k, True), mb(k)))
        acts += [Action(FULL, stage(k, True), mb(k)) for k in range(total - warm, total)]
        out.append(acts)
    return out


def zb_h1(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split; rank ``r`` runs ``p − r`` forwards, then for each
    micro-batch ``j``: ``B_j``, ``W_{j−r}`` (the weight gradient held back ``r`` micro-batches, so it fills the
    wait for the next gradient), the next forward; the held-back ``W`` drain last. Needs ``m ≥ p``.

    Bubble per rank ``(p − 1)(t_F + t_B − t_W)`` when ``t_W ≤ t_F`` and ``t_W ≤ t_B`` (1F1B's less ``2(p − 1)t_W``);
    peak in-flight activations ``p`` on every rank (1F1B's peak: an activation is freed by its ``W``).
    """
    out = []
    for r in range(p):
        warm = min(p - r, m)
        acts = [_f(r, j) for j in range(warm)]
        for j in range(m):
            acts.append(Action(INPUT, r, j))
            if j >= r:
                acts.append(Action(WEIGHT, r, j - r))
            if warm + j < m:
                acts.append(_f(r, warm + j))
        acts += [Action(WEIGHT, r, j) for j in range(max(m - r, 0), m)]
        out.append(acts)
    return out


def zbv(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """ZBV (Qi et al. 2024, section 6): two chunks per rank in a V (rank ``r``: stages ``r`` and ``2p − 1 − r``).
    Rank ``r``: ``2(p − r) − 1`` forwards of chunk 0; ``r`` pairs (F chunk 1, F chunk 0); ``p − r`` of (F, B, W on
    chunk 1); then (F, B, W chunk 0; F, B, W chunk 1) while forwards remain; ``r`` pairs (B chunk 0, B chunk 1);
    ``p − r`` of (B chunk 0, the oldest W chunk 0); the remaining W. Needs ``m ≥ 2p − 1``.

    Bubble per rank ``(p − 1)·t/2`` when ``t_F = t_B = t_W = t`` (the paper's condition for its zero bubble: what
    is left is half a chunk's step per hop, at the turn of the V); with unequal costs the simulator's count (no
    closed form here). Peak in-flight activations ``2p`` chunk-micro-batches on every rank, i.e. ``p``
    stage-micro-batches' worth: 1F1B's peak.
    """
    out = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        f = {c0: 0, c1: 0}
        b = {c0: 0, c1: 0}
        w = {c0: 0, c1: 0}
        acts: list[Action] = []

        def add(kind, stage):
            counter = {FORWARD: f, INPUT: b, WEIGHT: w}[kind]
            if counter[stage] < m:
                acts.append(Action(kind, stage, counter[stage]))
            counter[stage] += 1
        for _ in range(2 * (p - r) - 1):
            add(FORWARD, c0)
        for _ in range(r):
            add(FORWARD, c1)
            add(FORWARD, c0)
        for _ in range(p - r):
            add(FORWARD, c1)
            add(INPUT, c1)
            add(WEIGHT, c1)
        n = max(2 * p - 1, m)
        while f[c1] < f[c0] or f[c0] < n:
            if f[c0] < n:
                add(FORWARD, c0)
            add(INPUT, c0)
            add(WEIGHT, c0)
            add(FORWARD, c1)
            add(INPUT, c1)
            add(WEIGHT, c1)
        for _ in range(r):
            add(INPUT, c0)
            add(INPUT, c1)
        for _ in range(p - r):
            add(INPUT, c0)
            add(WEIGHT, c0)
        while w[c1] < b[c1]:
            add(WEIGHT, c1)
        while w[c0] < b[c0]:
            add(WEIGHT, c0)
        out.append(acts)
    return out


def dualpipev(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, rank ``r``: stages ``r`` and ``2p − 1 − r``), in 8 phases
    for rank ``r``: (1) ``2(p − r − 1)`` forwards of chunk 0; (2) ``r + 1`` pairs F chunk 0, F chunk 1; (3) ``p − r − 1``
    of (B chunk 1, a pending W, F chunk 1); (4) the main phase, ``m − 2p + r + 1`` of (F chunk 0 with BW chunk 1,
    F chunk 1 with BW chunk 0), each pair overlapped in DeepSeek's kernels and run one after the other here;
    (5) ``p − r − 1`` of (BW chunk 1; F chunk 1 with BW chunk 0); (6) ``r + 1`` of (backward chunk 1, backward
    chunk 0), from the middle on split into B with the W queued; (7) ``p − r − 1`` of (a pending W, backward
    chunk 0); (8) the pending W. Needs ``m ≥ 2p``.

    Bubble per rank ``(p − 1)·t/2`` when ``t_F = t_B = t_W = t``, ZBV's: run one after the other, an overlapped
    pair costs ``t_F + t_B + t_W``, so DeepSeek's saving (the pair's communication hidden under its compute, their
    ``(p − 1)(F&B + B − 3W)``) is not in this count; with unequal costs the simulator's count. Peak in-flight
    activations ``2p + 1`` chunk-micro-batches on every rank (one more than ZBV).
    """
    out = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        f = {c0: 0, c1: 0}
        b = {c0: 0, c1: 0}
        pending: list[Action] = []
        acts: list[Action] = []

        def forward(stage):
            acts.append(_f(stage, f[stage]))
            f[stage] += 1

        def backward(stage, split=False):
            acts.append(Action(INPUT if split else FULL, stage, b[stage]))
            if split:
                pending.append(Action(WEIGHT, stage, b[stage]))
            b[stage] += 1

        def weight():
            if pending:
                acts.append(pending.pop(0))
        for _ in range(2 * (p - r - 1)):
            forward(c0)
        for _ in range(r + 1):
            forward(c0)
            forward(c1)
        for _ in range(p - r - 1):
            backward(c1, split=True)
            weight()
            forward(c1)
        for _ in range(m - 2 * p + r + 1):
            forward(c0)
            backward(c1)
            forward(c1)
            backward(c0)
        for _ in range(p - r - 1):
            backward(c1)
            forward(c1)
            backward(c0)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            backward(c1, split)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            backward(c0, split)
        for _ in range(p - r - 1):
            weight()
            backward(c0, split)
        while pending:
            weight()
        out.append(acts)
    return out


#: name -> (generator, placement)
GENERATORS = {
    "gpipe": (gpipe, "loop"),
    "1f1b": (one_f_one_b, "loop"),
    "interleaved-1f1b": (interleaved_1f1b, "loop"),
    "zb-h1": (zb_h1, "loop"),
    "zbv": (zbv, "v"),
    "dualpipev": (dualpipev, "v"),
}
SCHEDULE_NAMES = tuple(GENERATORS)
#: chunks per rank each schedule takes: None = any v ≥ 1 given by --pp-virtual, else exactly this many
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": None, "zb-h1": 1, "zbv": 2, "dualpipev": 2}


def chunks_of(options: dict) -> int:
    """Stages per rank of a run's options: ``--pp-virtual``, or its ``--pp-schedule``'s own (1 without one)."""
    named = options.get("pp_schedule")
    if named is None:
        return 1
    return options.get("pp_virtual") or CHUNKS.get(named) or 2


def check_schedule(name: str, p: int, m: int, v: int) -> None:
    """Refuse what a schedule cannot run, in one line each: an unknown name, a chunk count it does not take,
    too few micro-batches."""
    if name not in GENERATORS:
        raise ConfigError(f"--pp-schedule {name!r}: choose one of {', '.join(SCHEDULE_NAMES)}")
    need = CHUNKS[name]
    if need is not None and v != need:
        why = "two chunks per rank, in a V" if need == 2 else "one stage per rank"
        raise ConfigError(f"--pp-schedule {name} runs {why}: use --pp-virtual {need}, not {v}")
    if name == "interleaved-1f1b" and v < 2:
        raise ConfigError("--pp-schedule interleaved-1f1b needs --pp-virtual >= 2 chunks per rank "
                          "(with 1 it is 1f1b)")
    least = {"gpipe": 1, "1f1b": p, "zb-h1": p, "interleaved-1f1b": p, "zbv": 2 * p - 1, "dualpipev": 2 * p}[name]
    if m < least:
        raise ConfigError(f"--pp-schedule {name} needs --num-microbatches >= {least} with pp={p}, got {m}")
    if name == "interleaved-1f1b" and m % p:
        raise ConfigError(f"--pp-schedule interleaved-1f1b sends micro-batches round by round, {p} at a time: "
                          f"--num-microbatches must be a multiple of pp={p}, got {m}")


@functools.lru_cache(maxsize=256)
def pipe_schedule(name: str, ranks: int, microbatches: int, chunks: int | None = None) -> PipeSchedule:
    """The schedule ``name`` for ``ranks`` ranks, ``microbatches`` micro-batches, ``chunks`` stages per rank
    (None: the schedule's own, 2 for interleaved), checked (:func:`check_schedule`); built once per arguments (the
    object is immutable)."""
    if chunks is None:
        chunks = CHUNKS.get(name) or 2
    check_schedule(name, ranks, microbatches, chunks)
    make, placement = GENERATORS[name]
    acts = make(ranks, microbatches, chunks)
    return PipeSchedule(name, ranks, microbatches, chunks, placement, tuple(tuple(a) for a in acts))

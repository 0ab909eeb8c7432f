"""A collective as plain data: who sends which chunk to whom, step by step, and what the receiver does.

A :class:`Schedule` for ``world_size`` ranks cuts every rank's vector of ``n`` elements into
``num_chunks`` contiguous chunks (``torch.tensor_split`` sizes: the first ``n % num_chunks`` chunks get
one element more). A :class:`Step` is a set of :class:`Transfer` that happen at the same time:

* every send reads the sender's chunks as they were at the *start* of the step;
* a ``"reduce"`` receive adds the data into the receiver's chunks, a ``"copy"`` receive overwrites them;
* when one rank reduces several messages into the same chunks in one step, the contributions (its own
  data included) are summed in ascending rank order, so every rank computes bit-identical sums.

The simulator (:mod:`labkit.collectives.simulate`), the executor (:mod:`labkit.collectives.execute`)
and the animation (:mod:`labkit.viz.allreduce`) all read this one description.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence

from labkit.errors import ConfigError


class ScheduleError(ConfigError):
    """A schedule breaks a rule (bad rank, self-send, chunk out of range, ...) or does not all-reduce."""


class Op(str, Enum):
    """What the receiver does with a chunk: add it to its own (``reduce``) or store it (``copy``)."""

    REDUCE = "reduce"
    COPY = "copy"


@dataclass(frozen=True)
class Transfer:
    """``src`` sends its chunks ``start .. stop-1`` (one contiguous slice) to ``dst``."""

    src: int
    dst: int
    start: int
    stop: int
    op: Op = Op.REDUCE

    def __post_init__(self):
        try:
            object.__setattr__(self, "op", Op(self.op))
        except ValueError:
            raise ScheduleError(f"unknown op {self.op!r} in {self.src}->{self.dst}; use 'reduce' or 'copy'") from None

    @property
    def chunks(self) -> range:
        return range(self.start, self.stop)

    def chunk_label(self) -> str:
        """``"chunk 2"`` or ``"chunks 0-1"``."""
        if self.stop - self.start == 1:
            return f"chunk {self.start}"
        return f"chunks {self.start}-{self.stop - 1}"

    def describe(self) -> str:
        """``"rank 2 sends chunk 0 to rank 3"`` (``"... to rank 3 (copy)"`` for a copy)."""
        tail = " (copy)" if self.op is Op.COPY else ""
        return f"rank {self.src} sends {self.chunk_label()} to rank {self.dst}{tail}"


@dataclass(frozen=True)
class Step:
    """Transfers that run concurrently, and the phase they belong to (e.g. ``"share-reduce"``)."""

    phase: str
    transfers: tuple[Transfer, ...]

    def name(self, index: int) -> str:
        """``"step 3 (share-reduce)"`` for 1-based ``index`` (no brackets without a phase)."""
        return f"step {index} ({self.phase})" if self.phase else f"step {index}"


@dataclass(frozen=True)
class Schedule:
    """An all-reduce (or parameter-server exchange) as data.

    Attributes:
        algorithm: name, e.g. ``"ring"``.
        world_size: number of ranks ``p``.
        num_chunks: into how many chunks each rank's vector is cut.
        steps: the steps in order.
        servers: ranks that hold no input of their own (parameter servers); their buffers start at zero
            and the result is the sum over the other ranks.
    """

    algorithm: str
    world_size: int
    num_chunks: int
    steps: tuple[Step, ...]
    servers: tuple[int, ...] = ()

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def transfers(self) -> list[Transfer]:
        return [t for step in self.steps for t in step.transfers]

    @property
    def contributors(self) -> tuple[int, ...]:
        """Ranks whose input is part of the sum."""
        return tuple(r for r in range(self.world_size) if r not in self.servers)

    def chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        """Element range ``[a, b)`` of every chunk of a length-``n`` vector (``tensor_split`` sizes)."""
        if n < 1:
            raise ConfigError(f"cannot all-reduce an empty vector (n={n}); pass at least one element")
        base, extra = divmod(n, self.num_chunks)
        bounds, a = [], 0
        for c in range(self.num_chunks):
            b = a + base + (1 if c < extra else 0)
            bounds.append((a, b))
            a = b
        return bounds

    def slice_of(self, transfer: Transfer, bounds: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """Element range of a transfer's chunks."""
        return bounds[transfer.start][0], bounds[transfer.stop - 1][1]

    def describe_step(self, index: int, limit: int = 4) -> str:
        """Caption of step ``index`` (1-based; 0 is the start), e.g.
        ``"step 3 of 6: share-reduce, rank 2 sends chunk 0 to rank 3"``."""
        total = self.num_steps
        if index == 0:
            return f"step 0 of {total}: start, every rank holds only its own data"
        step = self.steps[index - 1]
        parts = [t.describe() for t in step.transfers[:limit]]
        more = len(step.transfers) - limit
        if more > 0:
            parts.append(f"and {more} more")
        phase = f"{step.phase}, " if step.phase else ""
        return f"step {index} of {total}: {phase}" + ", ".join(parts)

    def validate(self) -> "Schedule":
        """Check the structural rules; returns ``self``. Raises :class:`ScheduleError` naming the step."""
        p = self.world_size
        if p < 2:
            raise ScheduleError(f"world_size must be >= 2 for an all-reduce, got {p}")
        if self.num_chunks < 1:
            raise ScheduleError(f"num_chunks must be >= 1, got {self.num_chunks}")
        for i, step in enumerate(self.steps, 1):
            pairs = set()
            for t in step.transfers:
                where = f"{step.name(i)}: {t.src}->{t.dst}"
                if not (0 <= t.src < p and 0 <= t.dst < p):
                    raise ScheduleError(f"{where}: ranks must be in 0..{p - 1}")
                if t.src == t.dst:
                    raise ScheduleError(f"{where}: a rank cannot send to itself")
                if not 0 <= t.start < t.stop <= self.num_chunks:
                    raise ScheduleError(f"{where}: chunk range {t.start}..{t.stop - 1} is outside "
                                        f"0..{self.num_chunks - 1}")
                if (t.src, t.dst) in pairs:
                    raise ScheduleError(f"{where}: two messages between the same pair in one step; "
                                        "merge them or put them in different steps")
                pairs.add((t.src, t.dst))
            _check_overlaps(i, step)
        return self


def _check_overlaps(index: int, step: Step) -> None:
    # A copy into chunks another message also writes in the same step would make the result order-dependent.
    by_dst: dict[int, list[Transfer]] = {}
    for t in step.transfers:
        by_dst.setdefault(t.dst, []).append(t)
    for dst, ts in by_dst.items():
        for i, a in enumerate(ts):
            for b in ts[i + 1:]:
                overlap = a.start < b.stop and b.start < a.stop
                if overlap and (a.op is Op.COPY or b.op is Op.COPY or (a.start, a.stop) != (b.start, b.stop)):
                    raise ScheduleError(f"{step.name(index)}: rank {dst} receives overlapping chunks "
                                        f"from ranks {a.src} and {b.src}; reduces into the same chunks must "
                                        "cover the same range and copies must not overlap")


def reduce_groups(transfers: Iterable[Transfer]) -> dict[tuple[int, int], list[Transfer]]:
    """Reduce receives of one rank in one step, grouped by chunk range, senders in rank order."""
    groups: dict[tuple[int, int], list[Transfer]] = {}
    for t in transfers:
        if t.op is Op.REDUCE:
            groups.setdefault((t.start, t.stop), []).append(t)
    return {k: sorted(v, key=lambda t: t.src) for k, v in sorted(groups.items())}


def sum_in_rank_order(parts: Sequence[tuple[int, object]]):
    """Sum ``(rank, tensor)`` pairs in ascending rank order into a new tensor (>= 2 parts).

    Float addition is not associative; a fixed order makes every rank that sums the same inputs get the
    same bits, so data-parallel replicas never drift apart.
    """
    ordered = [x for _, x in sorted(parts, key=lambda item: item[0])]
    acc = ordered[0] + ordered[1]
    for x in ordered[2:]:
        acc += x
    return acc


def from_steps(algorithm: str, world_size: int, num_chunks: int,
               steps: Iterable[Iterable[tuple]], phases: Sequence[str] | None = None) -> Schedule:
    """Build a schedule from plain tuples ``(src, dst, chunk, op)`` or ``(src, dst, start, stop, op)``.

    This is the format learners write in the exercise of notebook 01.
    """
    built = []
    for i, step in enumerate(steps):
        transfers = []
        for item in step:
            item = tuple(item)
            if len(item) == 4:
                src, dst, chunk, op = item
                transfers.append(Transfer(int(src), int(dst), int(chunk), int(chunk) + 1, op))
            elif len(item) == 5:
                transfers.append(Transfer(int(item[0]), int(item[1]), int(item[2]), int(item[3]), item[4]))
            else:
                raise ScheduleError(f"step {i + 1}: expected (src, dst, chunk, op), got {item!r}")
        built.append(Step(phases[i] if phases else "", tuple(transfers)))
    return Schedule(algorithm, world_size, num_chunks, tuple(built))

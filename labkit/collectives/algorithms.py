"""Ring, tree, master-worker, all-to-all and round-robin all-reduce as schedules.

Notation in every docstring: ``p`` ranks, ``n`` elements per rank, ``L = ceil(log2 p)``. Byte counts are
the element counts times the element size; "sends" and "receives" are per rank. Counts with ``n/p``
are exact when ``p`` divides ``n``; otherwise chunks differ by one element (``tensor_split`` sizes)
and the totals over all ranks stay exact.
"""
from __future__ import annotations

from labkit.collectives.schedule import Op, Schedule, ScheduleError, Step, Transfer


def check_world_size(world_size: int) -> int:
    """``world_size`` as an int >= 2, else a :class:`ScheduleError` naming it."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ScheduleError(f"world_size must be an integer >= 2, got {world_size!r}")
    if world_size < 2:
        raise ScheduleError(f"an all-reduce needs world_size >= 2 ranks, got {world_size}; "
                            "with one rank the input already is the sum")
    return world_size


def ring(world_size: int) -> Schedule:
    """Ring all-reduce: share-reduce (reduce-scatter) then share-only (all-gather).

    The vector is cut into ``p`` chunks; rank ``r`` always sends to ``(r + 1) % p``.

    * share-reduce step ``s = 0 .. p-2``: rank ``r`` sends chunk ``(r - s) % p``, the receiver adds it.
      Afterwards rank ``r`` holds the full sum of chunk ``(r + 1) % p``.
    * share-only step ``s = 0 .. p-2``: rank ``r`` sends chunk ``(r + 1 - s) % p``, the receiver stores it.

    Steps ``2(p-1)``; every rank sends and receives one message of ``n/p`` elements per step, so
    ``2(p-1)`` messages and ``2(p-1)/p * n`` elements each way per rank (all ranks: ``2(p-1) n``).
    Time ``2(p-1) (alpha + beta n/p)``: the bandwidth term hardly grows with ``p``.
    """
    p = check_world_size(world_size)
    steps = []
    for phase, op, offset in (("share-reduce", Op.REDUCE, 0), ("share-only", Op.COPY, 1)):
        for s in range(p - 1):
            steps.append(Step(phase, tuple(
                Transfer(r, (r + 1) % p, (r + offset - s) % p, (r + offset - s) % p + 1, op) for r in range(p))))
    return Schedule("ring", p, p, tuple(steps))


def tree(world_size: int) -> Schedule:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast back (the whole vector, 1 chunk).

    * reduce step ``k = 0 .. L-1``: ranks ``r = 2^k, 3*2^k, 5*2^k, ... < p`` send to ``r - 2^k`` (add).
    * broadcast step ``k = L-1 .. 0``: rank ``r - 2^k`` sends to those ``r`` (store).

    Steps ``2L``; ``2(p-1)`` messages of ``n`` elements in all. Rank 0 sends and receives ``L * n``;
    rank ``r > 0`` with ``c(r)`` children (``c(r) = #{k < trailing_zeros(r) : r + 2^k < p}``) sends and
    receives ``(1 + c(r)) * n``. Time ``2L (alpha + beta n)``: few steps, but every step moves all ``n``.
    """
    p = check_world_size(world_size)
    levels = (p - 1).bit_length()
    reduce = [Step(f"reduce (distance {1 << k})", tuple(
        Transfer(r, r - (1 << k), 0, 1, Op.REDUCE) for r in range(1 << k, p, 2 << k))) for k in range(levels)]
    broadcast = [Step(f"broadcast (distance {1 << k})", tuple(
        Transfer(r - (1 << k), r, 0, 1, Op.COPY) for r in range(1 << k, p, 2 << k)))
        for k in reversed(range(levels))]
    return Schedule("tree", p, 1, tuple(reduce + broadcast))


def master_worker(world_size: int) -> Schedule:
    """Master-worker: every worker sends its vector to the master (rank 0), which adds them all and
    sends the sum back to every worker.

    Steps 2; ``2(p-1)`` messages of ``n`` elements. The master receives ``(p-1) n`` and sends ``(p-1) n``;
    a worker sends ``n`` and receives ``n``. Time ``2((p-1) alpha + (p-1) beta n)``: the master's link is the
    bottleneck and grows with ``p``.
    """
    p = check_world_size(world_size)
    gather = Step("gather to master", tuple(Transfer(r, 0, 0, 1, Op.REDUCE) for r in range(1, p)))
    scatter = Step("master sends the sum", tuple(Transfer(0, r, 0, 1, Op.COPY) for r in range(1, p)))
    return Schedule("master-worker", p, 1, (gather, scatter))


def all_to_all(world_size: int) -> Schedule:
    """All-to-all: every rank sends its whole vector to every other rank; each adds what it receives.

    Steps 1; ``p(p-1)`` messages of ``n`` elements. Every rank sends ``(p-1) n`` and receives ``(p-1) n``.
    Time ``(p-1) alpha + (p-1) beta n``: one step, but far more bytes than needed.
    """
    p = check_world_size(world_size)
    step = Step("everyone sends to everyone", tuple(
        Transfer(src, dst, 0, 1, Op.REDUCE) for src in range(p) for dst in range(p) if src != dst))
    return Schedule("all-to-all", p, 1, (step,))


def round_robin(world_size: int) -> Schedule:
    """Round-robin all-reduce: the mastership is spread round-robin, rank ``i`` is master of chunk ``i``.

    The vector is cut into ``p`` chunks.

    * reduce-scatter (1 step): every rank sends chunk ``i`` straight to its owner, rank ``i``, which adds.
    * all-gather (1 step): every owner ``i`` sends its reduced chunk ``i`` to all other ranks.

    Steps 2; ``2p(p-1)`` messages of ``n/p`` elements. Every rank sends ``p-1`` messages per step, in all
    ``2(p-1)/p * n`` elements each way, the same bytes as the ring in 2 steps instead of ``2(p-1)``.
    Time ``2((p-1) alpha + (p-1)/p beta n)``.
    """
    p = check_world_size(world_size)
    scatter = Step("reduce-scatter to chunk owners", tuple(
        Transfer(r, c, c, c + 1, Op.REDUCE) for r in range(p) for c in range(p) if c != r))
    gather = Step("owners send their chunk to all", tuple(
        Transfer(c, r, c, c + 1, Op.COPY) for c in range(p) for r in range(p) if r != c))
    return Schedule("round-robin", p, p, (scatter, gather))

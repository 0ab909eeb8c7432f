"""Butterfly all-reduce (recursive doubling) and its halving-doubling variant (Rabenseifner).

Both pair rank ``r`` with ``r XOR d`` for distances ``d`` that are powers of two, which needs a
power-of-two number of ranks. For any other ``p`` the extra ranks are folded in first and out at the end:
with ``q = 2^floor(log2 p)`` and ``e = p - q`` extra ranks,

* fold (1 step): extra rank ``q + i`` sends its whole vector to rank ``i``, which adds it;
* the ``q`` core ranks run the power-of-two algorithm;
* unfold (1 step): rank ``i`` sends the finished vector back to rank ``q + i``, which stores it.

Notation: ``m = log2 q``; the extra terms below apply only when ``e > 0``.
"""
from __future__ import annotations

from labkit.collectives.algorithms import check_world_size
from labkit.collectives.schedule import Op, Schedule, Step, Transfer


def _fold(p: int, q: int, chunks: int) -> tuple[list[Step], list[Step]]:
    if p == q:
        return [], []
    fold = Step("fold extra ranks in", tuple(Transfer(r, r - q, 0, chunks, Op.REDUCE) for r in range(q, p)))
    unfold = Step("send the sum to the extra ranks", tuple(
        Transfer(r - q, r, 0, chunks, Op.COPY) for r in range(q, p)))
    return [fold], [unfold]


def butterfly(world_size: int) -> Schedule:
    """Butterfly (recursive doubling): in step ``k`` rank ``r`` swaps its whole vector with ``r XOR 2^k``
    and both add, so after ``m`` steps every core rank holds the sum.

    Steps ``m`` (+2 with extra ranks). A core rank sends and receives ``m`` messages of ``n`` elements
    (``m * n`` each way; core ranks ``r < e`` also receive ``n`` in the fold and send ``n`` in the
    unfold); an extra rank sends ``n`` and receives ``n``. Time ``m (alpha + beta n)`` (+``2(alpha + beta n)``):
    the fewest steps, every step moves all ``n``.
    """
    p = check_world_size(world_size)
    q = 1 << (p.bit_length() - 1)
    fold, unfold = _fold(p, q, 1)
    exchange = [Step(f"exchange (distance {d})", tuple(Transfer(r, r ^ d, 0, 1, Op.REDUCE) for r in range(q)))
                for d in (1 << k for k in range(q.bit_length() - 1))]
    return Schedule("butterfly", p, 1, tuple(fold + exchange + unfold))


def rabenseifner(world_size: int) -> Schedule:
    """Halving-doubling (Rabenseifner): recursive-halving reduce-scatter, then recursive-doubling
    all-gather. The vector is cut into ``q`` chunks.

    * halving step with distance ``d = q/2, q/4, .., 1``: rank ``r`` and ``r XOR d`` split the chunks they
      are responsible for; the rank with bit ``d`` clear keeps the lower half and sends the upper half,
      its partner the opposite, and each adds what it receives. Afterwards rank ``r`` owns chunk ``r``.
    * doubling step with distance ``d = 1, 2, .., q/2``: partners swap the blocks they own (store).

    Steps ``2m`` (+2 with extra ranks). A core rank sends and receives ``2m`` messages holding
    ``2(q-1)/q * n`` elements each way (+``n`` for core ranks ``r < e``); an extra rank sends and receives ``n``.
    Time ``2m alpha + 2(q-1)/q beta n``: log-many steps and ring-like bytes.
    """
    p = check_world_size(world_size)
    q = 1 << (p.bit_length() - 1)
    fold, unfold = _fold(p, q, q)
    distances = [q >> (k + 1) for k in range(q.bit_length() - 1)]  # q/2, q/4, ..., 1
    lo, hi = [0] * q, [q] * q
    halving = []
    for d in distances:
        transfers = []
        for r in range(q):
            mid = (lo[r] + hi[r]) // 2
            send = (mid, hi[r]) if r & d == 0 else (lo[r], mid)
            transfers.append(Transfer(r, r ^ d, send[0], send[1], Op.REDUCE))
        for r in range(q):
            mid = (lo[r] + hi[r]) // 2
            lo[r], hi[r] = (lo[r], mid) if r & d == 0 else (mid, hi[r])
        halving.append(Step(f"reduce-scatter, halving (distance {d})", tuple(transfers)))
    doubling = []
    for d in reversed(distances):
        # Before this step rank r owns the block of d chunks starting at (r // d) * d.
        doubling.append(Step(f"all-gather, doubling (distance {d})", tuple(
            Transfer(r, r ^ d, (r // d) * d, (r // d) * d + d, Op.COPY) for r in range(q))))
    return Schedule("rabenseifner", p, q, tuple(fold + halving + doubling + unfold))

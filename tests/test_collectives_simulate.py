"""The simulator: every schedule sums correctly, and its counts equal the formulas in the docstrings."""
import math

import pytest
import torch

from labkit.collectives import (
    SCHEDULES,
    ScheduleError,
    count,
    coverage,
    from_steps,
    get_schedule,
    parameter_server,
    simulate,
)

WORLD_SIZES = range(2, 10)
LENGTHS = (1, 2, 7, 24, 25, 360, 361)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_sums_on_every_rank(name):
    for p in WORLD_SIZES:
        for n in LENGTHS:
            schedule = get_schedule(name, p)
            gen = torch.Generator().manual_seed(p * 1000 + n)
            inputs = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(p)]
            out = simulate(schedule, inputs).outputs
            want = sum(inputs[r] for r in schedule.contributors)
            for r in schedule.contributors:
                torch.testing.assert_close(out[r], want, rtol=1e-12, atol=1e-12)
                # the summation order is fixed, so all ranks hold the very same bits
                assert torch.equal(out[r], out[schedule.contributors[0]])


def test_ring_counts_match_formula():
    for p in WORLD_SIZES:
        n = 12 * p
        c = count(get_schedule("ring", p), n)
        assert c.steps == 2 * (p - 1)
        assert c.messages_sent == c.messages_recv == [2 * (p - 1)] * p
        assert c.elements_sent == c.elements_recv == [2 * (p - 1) * n // p] * p
        assert c.bytes_sent(8) == c.bytes_recv(8) == [8 * 2 * (p - 1) * n // p] * p
        ragged = count(get_schedule("ring", p), n + 1)            # not divisible: totals still exact
        assert ragged.total_elements == 2 * (p - 1) * (n + 1)


def test_tree_counts_match_formula():
    for p in WORLD_SIZES:
        n, levels = 10, math.ceil(math.log2(p))

        def children(r):
            below = (r & -r).bit_length() - 1 if r else levels      # trailing zeros; all levels for the root
            return sum(1 for k in range(below) if r + (1 << k) < p)

        c = count(get_schedule("tree", p), n)
        assert c.steps == 2 * levels
        assert c.total_messages == 2 * (p - 1)
        assert c.elements_sent[0] == c.elements_recv[0] == levels * n
        want = [n * (children(r) + (r != 0)) for r in range(p)]
        assert c.elements_sent == c.elements_recv == want


def test_butterfly_counts_match_formula():
    for p in WORLD_SIZES:
        n, q = 10, 1 << int(math.log2(p))
        e, m = p - q, int(math.log2(q))
        c = count(get_schedule("butterfly", p), n)
        assert c.steps == m + (2 if e else 0)
        assert c.elements_sent == [m * n + (n if r < e else 0) if r < q else n for r in range(p)]
        assert c.elements_recv == c.elements_sent


def test_rabenseifner_counts_match_formula():
    for p in WORLD_SIZES:
        q = 1 << int(math.log2(p))
        e, m, n = p - q, int(math.log2(q)), 8 * q
        c = count(get_schedule("rabenseifner", p), n)
        assert c.steps == 2 * m + (2 if e else 0)
        core = 2 * (q - 1) * n // q
        assert c.elements_sent == [core + (n if r < e else 0) if r < q else n for r in range(p)]
        assert c.messages_sent == [2 * m + (r < e) if r < q else 1 for r in range(p)]


def test_master_worker_all_to_all_round_robin_counts_match_formula():
    for p in WORLD_SIZES:
        n = 6 * p
        mw = count(get_schedule("master-worker", p), n)
        assert mw.steps == 2 and mw.total_messages == 2 * (p - 1)
        assert mw.elements_sent == mw.elements_recv == [(p - 1) * n] + [n] * (p - 1)
        a2a = count(get_schedule("all-to-all", p), n)
        assert a2a.steps == 1 and a2a.total_messages == p * (p - 1)
        assert a2a.elements_sent == a2a.elements_recv == [(p - 1) * n] * p
        rr = count(get_schedule("round-robin", p), n)
        assert rr.steps == 2 and rr.messages_sent == [2 * (p - 1)] * p
        assert rr.elements_sent == rr.elements_recv == [2 * (p - 1) * n // p] * p


def test_parameter_server_counts_match_formula():
    p, servers, n = 7, 2, 40
    workers = p - servers
    c = count(parameter_server(p, servers), n)
    assert c.steps == 2 and c.total_messages == 2 * servers * workers
    assert c.elements_sent == [workers * n // servers] * servers + [n] * workers


def test_per_step_counts_are_the_busiest_rank():
    steps = count(get_schedule("master-worker", 4), 8).per_step
    assert [(s.messages, s.elements, s.reduced) for s in steps] == [(3, 24, 24), (3, 24, 0)]


def test_ring_coverage_after_share_reduce():
    p = 4
    frames = coverage(get_schedule("ring", p))
    after_reduce = frames[p - 1]
    for r in range(p):
        assert after_reduce[r][(r + 1) % p] == frozenset(range(p))   # rank r owns the sum of chunk r+1
    assert all(chunk == frozenset(range(p)) for rank in frames[-1] for chunk in rank)


def test_double_counting_is_caught_with_the_step_and_ranks():
    twice = from_steps("bad", 2, 1, [[(0, 1, 0, "reduce"), (1, 0, 0, "reduce")], [(1, 0, 0, "reduce")]])
    with pytest.raises(ScheduleError, match=r"step 2: rank 0 adds chunk 0 from rank 1, but both already contain "
                                            r"data of rank\(s\) 0, 1: it would be counted twice"):
        simulate(twice)


def test_incomplete_schedule_is_caught():
    half = from_steps("half", 3, 3, [[(0, 1, 0, "reduce")]])
    with pytest.raises(ScheduleError, match=r"after the last step rank 0 chunk 0 holds data of rank\(s\) 0; "
                                            r"missing rank\(s\) 1, 2"):
        simulate(half)

"""Schedules as literal data (ring and tree for p=3 and p=4, and more), and bad input -> clear errors."""
import pytest
import torch

from labkit.collectives import (
    ALGORITHMS,
    SCHEDULES,
    Op,
    Schedule,
    ScheduleError,
    Step,
    Transfer,
    from_steps,
    get_schedule,
    parameter_server,
    parse_algorithms,
    simulate,
)
from labkit.errors import ConfigError

R, C = Op.REDUCE, Op.COPY


def steps_of(schedule: Schedule) -> list[list[tuple]]:
    return [[(t.src, t.dst, t.start, t.stop, t.op) for t in step.transfers] for step in schedule.steps]


def test_ring_p3_literal():
    s = get_schedule("ring", 3)
    assert s.num_chunks == 3
    assert [st.phase for st in s.steps] == ["share-reduce"] * 2 + ["share-only"] * 2
    assert steps_of(s) == [
        [(0, 1, 0, 1, R), (1, 2, 1, 2, R), (2, 0, 2, 3, R)],
        [(0, 1, 2, 3, R), (1, 2, 0, 1, R), (2, 0, 1, 2, R)],
        [(0, 1, 1, 2, C), (1, 2, 2, 3, C), (2, 0, 0, 1, C)],
        [(0, 1, 0, 1, C), (1, 2, 1, 2, C), (2, 0, 2, 3, C)],
    ]


def test_ring_p4_literal():
    assert steps_of(get_schedule("ring", 4)) == [
        [(0, 1, 0, 1, R), (1, 2, 1, 2, R), (2, 3, 2, 3, R), (3, 0, 3, 4, R)],
        [(0, 1, 3, 4, R), (1, 2, 0, 1, R), (2, 3, 1, 2, R), (3, 0, 2, 3, R)],
        [(0, 1, 2, 3, R), (1, 2, 3, 4, R), (2, 3, 0, 1, R), (3, 0, 1, 2, R)],
        [(0, 1, 1, 2, C), (1, 2, 2, 3, C), (2, 3, 3, 4, C), (3, 0, 0, 1, C)],
        [(0, 1, 0, 1, C), (1, 2, 1, 2, C), (2, 3, 2, 3, C), (3, 0, 3, 4, C)],
        [(0, 1, 3, 4, C), (1, 2, 0, 1, C), (2, 3, 1, 2, C), (3, 0, 2, 3, C)],
    ]


def test_tree_p3_and_p4_literal():
    assert steps_of(get_schedule("tree", 3)) == [
        [(1, 0, 0, 1, R)], [(2, 0, 0, 1, R)], [(0, 2, 0, 1, C)], [(0, 1, 0, 1, C)]]
    assert steps_of(get_schedule("tree", 4)) == [
        [(1, 0, 0, 1, R), (3, 2, 0, 1, R)], [(2, 0, 0, 1, R)], [(0, 2, 0, 1, C)], [(0, 1, 0, 1, C), (2, 3, 0, 1, C)]]


def test_butterfly_folds_the_extra_rank_for_p3():
    assert steps_of(get_schedule("butterfly", 3)) == [
        [(2, 0, 0, 1, R)], [(0, 1, 0, 1, R), (1, 0, 0, 1, R)], [(0, 2, 0, 1, C)]]


def test_rabenseifner_p4_literal():
    assert steps_of(get_schedule("rabenseifner", 4)) == [
        [(0, 2, 2, 4, R), (1, 3, 2, 4, R), (2, 0, 0, 2, R), (3, 1, 0, 2, R)],   # halving, distance 2
        [(0, 1, 1, 2, R), (1, 0, 0, 1, R), (2, 3, 3, 4, R), (3, 2, 2, 3, R)],   # halving, distance 1
        [(0, 1, 0, 1, C), (1, 0, 1, 2, C), (2, 3, 2, 3, C), (3, 2, 3, 4, C)],   # doubling, distance 1
        [(0, 2, 0, 2, C), (1, 3, 0, 2, C), (2, 0, 2, 4, C), (3, 1, 2, 4, C)],   # doubling, distance 2
    ]


def test_round_robin_master_worker_all_to_all_p3_literal():
    assert steps_of(get_schedule("round-robin", 3)) == [
        [(0, 1, 1, 2, R), (0, 2, 2, 3, R), (1, 0, 0, 1, R), (1, 2, 2, 3, R), (2, 0, 0, 1, R), (2, 1, 1, 2, R)],
        [(0, 1, 0, 1, C), (0, 2, 0, 1, C), (1, 0, 1, 2, C), (1, 2, 1, 2, C), (2, 0, 2, 3, C), (2, 1, 2, 3, C)],
    ]
    assert steps_of(get_schedule("master-worker", 3)) == [[(1, 0, 0, 1, R), (2, 0, 0, 1, R)],
                                                          [(0, 1, 0, 1, C), (0, 2, 0, 1, C)]]
    assert steps_of(get_schedule("all-to-all", 3)) == [[(0, 1, 0, 1, R), (0, 2, 0, 1, R), (1, 0, 0, 1, R),
                                                        (1, 2, 0, 1, R), (2, 0, 0, 1, R), (2, 1, 0, 1, R)]]


def test_parameter_server_two_servers_literal():
    s = parameter_server(4, num_servers=2)
    assert s.servers == (0, 1) and s.contributors == (2, 3)
    assert steps_of(s) == [[(2, 0, 0, 1, R), (2, 1, 1, 2, R), (3, 0, 0, 1, R), (3, 1, 1, 2, R)],
                           [(0, 2, 0, 1, C), (0, 3, 0, 1, C), (1, 2, 1, 2, C), (1, 3, 1, 2, C)]]


def test_names_are_stable():
    assert ALGORITHMS == ("ring", "tree", "butterfly", "rabenseifner", "master-worker", "all-to-all", "round-robin")
    assert SCHEDULES == ALGORITHMS + ("parameter-server",)
    assert parse_algorithms("all") == list(ALGORITHMS)
    assert parse_algorithms("ring, tree") == ["ring", "tree"]


def test_chunk_bounds_follow_tensor_split():
    s = get_schedule("ring", 4)
    for n in (1, 3, 4, 10, 13):
        sizes = [b - a for a, b in s.chunk_bounds(n)]
        assert sizes == [len(c) for c in torch.tensor_split(torch.arange(n), 4)]


def test_caption_names_the_step():
    s = get_schedule("ring", 4)
    assert s.describe_step(0) == "step 0 of 6: start, every rank holds only its own data"
    assert s.describe_step(3).startswith("step 3 of 6: share-reduce, ")
    assert "rank 2 sends chunk 0 to rank 3" in s.describe_step(3)
    assert "rank 0 sends chunk 1 to rank 1 (copy)" in s.describe_step(4)


@pytest.mark.parametrize("p", [1, 0, -3])
def test_world_size_below_two_is_rejected(p):
    with pytest.raises(ScheduleError, match=rf"world_size >= 2 ranks, got {p}"):
        get_schedule("ring", p)


def test_non_integer_world_size_is_rejected():
    with pytest.raises(ScheduleError, match=r"world_size must be an integer >= 2, got '4'"):
        get_schedule("tree", "4")


def test_unknown_algorithm_is_rejected():
    with pytest.raises(ConfigError, match=r"unknown all-reduce algorithm 'rings'; choose from ring, tree"):
        get_schedule("rings", 4)
    with pytest.raises(ConfigError, match=r"unknown all-reduce algorithm 'bogus'"):
        parse_algorithms("ring,bogus")


def test_empty_vector_is_rejected():
    with pytest.raises(ConfigError, match=r"cannot all-reduce an empty vector \(n=0\)"):
        simulate(get_schedule("ring", 3), [torch.zeros(0)] * 3)


def test_bad_parameter_server_split_is_rejected():
    with pytest.raises(ScheduleError, match=r"num_servers must be between 1 and world_size - 1 = 3"):
        parameter_server(4, num_servers=4)


@pytest.mark.parametrize("transfers, message", [
    ([Transfer(0, 0, 0, 1)], r"step 1 \(x\): 0->0: a rank cannot send to itself"),
    ([Transfer(0, 5, 0, 1)], r"step 1 \(x\): 0->5: ranks must be in 0..2"),
    ([Transfer(0, 1, 2, 4)], r"chunk range 2..3 is outside 0..2"),
    ([Transfer(0, 1, 0, 1), Transfer(0, 1, 1, 2)], r"two messages between the same pair in one step"),
    ([Transfer(0, 2, 0, 1, Op.COPY), Transfer(1, 2, 0, 2)], r"rank 2 receives overlapping chunks from ranks 0 and 1"),
])
def test_structural_rules(transfers, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule("custom", 3, 3, (Step("x", tuple(transfers)),)).validate()


def test_from_steps_reads_learner_tuples_and_rejects_bad_ones():
    s = from_steps("mine", 2, 2, [[(0, 1, 0, "reduce"), (1, 0, 1, "reduce")], [(0, 1, 1, "copy"), (1, 0, 0, "copy")]])
    assert simulate(s, n=5).outputs[0].tolist() == simulate(get_schedule("ring", 2), n=5).outputs[0].tolist()
    with pytest.raises(ScheduleError, match=r"unknown op 'add' in 0->1; use 'reduce' or 'copy'"):
        from_steps("mine", 2, 2, [[(0, 1, 0, "add")]])
    with pytest.raises(ScheduleError, match=r"step 1: expected \(src, dst, chunk, op\), got \(0, 1\)"):
        from_steps("mine", 2, 2, [[(0, 1)]])

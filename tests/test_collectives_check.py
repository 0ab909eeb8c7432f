"""The ring exercise checker: right answers pass, wrong ones get the precise reason, learner bugs never crash."""
import pytest

from labkit.checks import run_check
from labkit.collectives.check import check_ring, check_schedule, main, reference_ring
from labkit.errors import ConfigError


def test_reference_solution_passes():
    report = check_ring(reference_ring)
    assert report.ok and list(report.results) == [2, 3, 4, 5]
    assert "Well done" in str(report)


def test_non_neighbour_send_is_named():
    def skip_one(p):
        steps = reference_ring(p)
        steps[1][0] = (0, 2, steps[1][0][2], "reduce")
        return steps

    problems = check_schedule(skip_one(4), 4)
    assert problems[0] == "step 2: rank 0 sends to rank 2, but in a ring rank 0 may only send to its neighbour rank 1"


def test_idle_rank_and_step_count_are_named():
    steps = reference_ring(4)[:-1]
    steps[0] = steps[0][1:]                    # rank 0 sends nothing in step 1
    problems = check_schedule(steps, 4)
    assert "expected 2(p-1) = 6 steps (3 share-reduce + 3 share-only), got 5" in problems
    assert "step 1: rank(s) 0 send nothing; in the ring every rank sends one chunk per step" in problems


def test_double_counting_learner_stub_is_explained():
    def always_own_chunk(p):                   # a typical first attempt: every step sends chunk r
        return [[(r, (r + 1) % p, r, "reduce") for r in range(p)] for _ in range(2 * (p - 1))]

    problems = check_ring(always_own_chunk).results[3]
    assert problems == ["step 2: rank 0 adds chunk 2 from rank 2, but both already contain data of rank(s) 2: "
                        "it would be counted twice"]


def test_copy_instead_of_reduce_loses_data():
    def all_copies(p):
        return [[(a, b, c, "copy") for a, b, c, _ in step] for step in reference_ring(p)]

    problems = check_schedule(all_copies(3), 3)
    # chunk 0 travels 0 -> 1 -> 2 -> 0 being overwritten, never added: only rank 0's own data is left
    assert problems == ["after the last step rank 0 chunk 0 holds data of rank(s) 0; missing rank(s) 1, 2"]


def test_learner_errors_are_reported_not_raised():
    report = check_ring(lambda p: [[(0, 1, 0)]])
    assert not report.ok
    assert report.results[2] == ["cannot read the returned steps: step 1: expected (src, dst, chunk, op), got "
                                 "(0, 1, 0) (expected a list of steps, each a list of (src, dst, chunk, op) tuples)"]
    report = check_ring(lambda p: 1 // 0)
    assert report.results[5] == ["ring_schedule(5) raised ZeroDivisionError: integer division or modulo by zero"]


def test_command_line_checks_a_file(tmp_path, capsys):
    good = tmp_path / "good.py"
    good.write_text("from labkit.collectives.check import reference_ring as ring_schedule\n")
    bad = tmp_path / "bad.py"
    bad.write_text("def mine(p):\n    return [[(r, (r + 2) % p, r, 'reduce') for r in range(p)]]\n")
    assert main([str(good)]) == 0
    assert run_check("allreduce", [f"{bad}:mine", "--ranks", "3"]) == 1
    out = capsys.readouterr().out
    assert "p=3 WRONG" in out and "rank 0 sends to rank 2, but in a ring rank 0 may only send to its neighbour" in out


def test_command_line_bad_input():
    with pytest.raises(ConfigError, match=r"no such file 'missing.py'; pass the Python file that defines ring_sch"):
        main(["missing.py"])
    with pytest.raises(ConfigError, match=r"--ranks '1': give world sizes >= 2"):
        main(["--ranks", "1"])

"""The ring exercise checker: right answers pass, wrong ones get the precise reason, learner bugs never crash."""
import pytest

from labkit.errors import ConfigError
from labkit.exercises.allreduce import check_ring, check_schedule, main, reference_ring
from labkit.exercises.cli import run_check


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
    assert ("expected 2(p-1) = 6 steps (3 share-reduce + 3 share-only), got 5 (3 share-reduce + 2 share-only)"
            in problems)
    assert ("the share-only phase has 2 step(s), one too few: it takes p-1 = 3 steps, so that each of the p chunks "
            "travels past the other p-1 ranks (`for s in range(p - 1)`)") in problems
    assert "step 1: rank(s) 0 send nothing; in the ring every rank sends one chunk per step" in problems


def test_double_counting_learner_stub_is_explained():
    def always_own_chunk(p):                   # a typical first attempt: every step sends chunk r
        return [[(r, (r + 1) % p, r, "reduce") for r in range(p)] for _ in range(2 * (p - 1))]

    problems = check_ring(always_own_chunk).results[3]
    assert problems == ["step 2 (share-reduce step 2): rank 0 sends chunk 0, but it must pass on chunk 2, the chunk it "
                        "received in step 1 (off by one: the chunk after the one that arrived); in every step after "
                        "the first, each rank forwards the chunk that arrived in the step before (as do 2 other "
                        "rank(s) in this step)",
                        "step 2: rank 0 adds chunk 2 from rank 2, but both already contain data of rank(s) 2: "
                        "it would be counted twice"]


def test_off_by_one_chunk_is_named_in_its_phase_and_step():
    """Not only the end state: the step and chunk where share-reduce or share-only went one chunk off."""
    def shift(steps, first, last, by):
        return [[(a, b, (c + by) % 4 if first <= i < last else c, op) for a, b, c, op in step]
                for i, step in enumerate(steps)]

    ring = reference_ring(4)  # steps 1-3 share-reduce, 4-6 share-only
    reduce_off = check_schedule(shift(ring, 1, 3, 1), 4)  # share-reduce steps 2 and 3 send the next chunk
    assert reduce_off[0].startswith("step 2 (share-reduce step 2): rank 0 sends chunk 0, but it must pass on "
                                    "chunk 3, the chunk it received in step 1 (off by one: the chunk after")
    gather_off = check_schedule(shift(ring, 3, 6, -1), 4)  # every share-only step sends the chunk before
    assert gather_off[0].startswith("step 4 (share-only step 1): rank 0 sends chunk 0, but it must pass on "
                                    "chunk 1, the chunk it received in step 3 (off by one: the chunk before")
    assert gather_off[-1].startswith("after the last step rank 0")  # the end state still follows
    extra = check_schedule(ring[:3] + ring[:1] + ring[3:], 4)  # one share-reduce step too many
    assert extra[:2] == ["expected 2(p-1) = 6 steps (3 share-reduce + 3 share-only), got 7 (4 share-reduce + 3 "
                         "share-only)", "the share-reduce phase has 4 step(s), one too many: it takes p-1 = 3 steps, "
                         "so that each of the p chunks travels past the other p-1 ranks (`for s in range(p - 1)`)"]
    swapped = check_schedule(ring[3:] + ring[:3], 4)
    assert ("a share-reduce step comes after a share-only step: first all p-1 share-reduce steps (every chunk "
            "summed on one rank), then the p-1 share-only steps") in swapped


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
    good.write_text("from labkit.exercises.allreduce import reference_ring as ring_schedule\n")
    bad = tmp_path / "bad.py"
    bad.write_text("def mine(p):\n    return [[(r, (r + 2) % p, r, 'reduce') for r in range(p)]]\n")
    assert main([str(good)]) == 0
    assert run_check("allreduce", [f"{bad}:mine", "--ranks", "3"]) == 1
    out = capsys.readouterr().out
    assert "p=3 WRONG" in out and "rank 0 sends to rank 2, but in a ring rank 0 may only send to its neighbour" in out


def test_a_file_that_does_not_parse_is_one_line_with_its_line_number(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def ring_schedule(p):\n    return [[(0, 1, 0, 'reduce')]\n")
    with pytest.raises(ConfigError) as err:
        main([str(broken)])
    assert str(err.value) == f"{broken}, line 2: '[' was never closed; fix it, then run the check again"
    raising = tmp_path / "raising.py"
    raising.write_text("import math\n\nSTEPS = math.sqrt(-1)\n")
    with pytest.raises(ConfigError, match=r"raising.py, line 3: importing it raised ValueError: math domain error"):
        main([str(raising)])
    from labkit.cli import main as labkit

    assert labkit(["check", "allreduce", str(broken)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"labkit: error: {broken}, line 2: '[' was never closed; "
                                                          "fix it, then run the check again"]


def test_command_line_bad_input():
    with pytest.raises(ConfigError, match=r"no such file 'missing.py'; pass the Python file that defines ring_sch"):
        main(["missing.py"])
    with pytest.raises(ConfigError, match=r"--ranks '1': give world sizes >= 2"):
        main(["--ranks", "1"])

"""labkit faults: each broken program ends with its diagnosis within a bounded time (the watchdog's table for a
hang, a finding for a silent failure), each fixed version trains right, and ``labkit check faults-NAME``
rejects the untouched program and accepts the fix."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from labkit import faults
from labkit.cli import main
from labkit.exercises.cli import run_check
from labkit.faults.check import PEER_GONE, reference
from labkit.faults.common import toy_data, toy_model
from labkit.faults.runner import Outcome, run_fault, run_program
from labkit.faults.table import describe, hang_table
from labkit.faults.versus import last_epoch_loss
from labkit.faults.watchdog import start_for_training, waiting_in

HANGS = ["mismatched-collective", "rank0-evaluates", "uneven-inputs", "send-recv-deadlock"]


def _now(outcome, rank):
    """The collective ``rank`` was waiting in when the watchdog fired."""
    return next(r for r in outcome.hang["reports"] if r["rank"] == rank)["current"]


def test_every_hang_ends_with_a_table_naming_the_mismatch():
    # the four hang at once (each waits 4 s in a collective; none busies the cores meanwhile)
    with ThreadPoolExecutor(len(HANGS)) as pool:
        runs = dict(zip(HANGS, pool.map(lambda n: run_fault(n, watchdog=4.0, timeout=120), HANGS)))
    for name, run in runs.items():
        assert run.status == "hung", (name, run.status, run.error, run.logs)
        assert len(run.hang["reports"]) == 2, name
    # 2 epochs of 8 steps x 4 gradients = all-reduces #1..#32; then rank 0 alone all-reduces, rank 1 is at barrier
    table = runs["mismatched-collective"].table
    assert "rank 0 is in all_reduce #33 of shape (10,) float32, rank 1 is in barrier #33" in table
    assert "mismatched_collective.py:37 dist.all_reduce(correct)" in table
    evaluates = runs["rank0-evaluates"].table
    assert "rank 0 is in all_reduce #33 of shape (2,) float32, rank 1 is in barrier #33" in evaluates
    assert "rank0_evaluates.py:21 dist.all_reduce(counts)" in evaluates
    # 257 samples: rank 0 has 5 batches, rank 1 has 4 (16 all-reduces); rank 0's fifth step waits
    uneven = runs["uneven-inputs"].table
    assert "rank 0 is in all_reduce #17 of shape (32, 20) float32, rank 1 is in barrier #17" in uneven
    assert _now(runs["uneven-inputs"], 0)["op"] == "all_reduce"
    deadlock = runs["send-recv-deadlock"]
    assert [(_now(deadlock, r)["op"], _now(deadlock, r)["peer"], _now(deadlock, r)["shape"])
            for r in (0, 1)] == [("send", 1, [1002]), ("send", 0, [1002])]  # 20*32+32 + 32*10+10 weights
    assert "every rank sends and none receives" in deadlock.table


def test_silent_failures_are_found():
    found = {name: run_fault(name).findings for name in ("no-set-epoch", "unsynced-init", "local-rank", "nan-spreads")}
    assert found["no-set-epoch"] == ["rank 0 saw its 256 samples in the same order in all 3 epochs: DistributedSampler "
                                     "shuffles by (seed, epoch); call sampler.set_epoch(epoch) before each epoch"]
    assert len(found["unsynced-init"]) == 1 and found["unsynced-init"][0].startswith("replicas differ after step 1")
    assert found["local-rank"][0].startswith("ranks 0 and 1 both use GPU 0 on node0")
    # sample 75 is rank 1's 38th (no shuffling): its second batch, so step 2's first all-reduce (call 5)
    assert found["nan-spreads"][0].startswith("rank 1 was first to put a non-finite value into a collective: "
                                              "all_reduce call 5 (shape (32, 20)) in step 2")
    assert "ranks 0, 1 hold non-finite weights" in found["nan-spreads"][0]


@pytest.fixture(scope="module")
def fixed():
    return {name: reference(name, 2) for name in faults.FAULTS}  # the runs the checker compares with


def test_every_fixed_version_finishes_with_equal_replicas_and_nothing_found(fixed):
    for name, run in fixed.items():
        assert (run.status, run.findings) == ("finished", []), (name, run.error, run.table)
        alive = [r["rank"] for r in run.ranks]
        assert alive == [r for r in (0, 1) if r != faults.FAULTS[name].lost] and run.lost == ([1] if name == "replica-lost" else []), name
        assert all(torch.equal(run.state(0)[k], run.state(r)[k]) for r in alive for k in run.state(0)), name


def test_fixed_data_parallel_equals_one_process_on_the_global_batch(fixed):
    """2 ranks x batch 32 with averaged gradients = one process on both ranks' batches (64), step by step."""
    data = toy_data()
    torch.manual_seed(0)
    model = toy_model()
    for epoch in range(2):
        orders = []
        for rank in (0, 1):
            sampler = DistributedSampler(data, num_replicas=2, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(8):
            batches = [order[step * 32:(step + 1) * 32] for order in orders]
            x, y = data[sum(batches, [])]
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():  # plain SGD, lr 0.1
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
    run = fixed["mismatched-collective"]
    for k, v in model.state_dict().items():
        assert torch.allclose(run.state(0)[k], v, atol=1e-6), k
    assert len(run.ranks[0]["losses"]) == 16


def test_a_lost_replica_ends_plain_data_parallelism_and_the_fix_trains_on_alone(fixed):
    """Rank 1 exits in step 5 (of 8 per epoch, 2 epochs): the broken program's rank 0 fails in that step's
    all-reduce; the fix discards that step and trains the other 10 alone, on its own shard (15 steps in all)."""
    broken = run_fault("replica-lost")
    assert (broken.status, broken.lost, [f["rank"] for f in broken.failures]) == ("failed", [1], [0])
    assert any(words in broken.failures[0]["message"] for words in PEER_GONE)  # gloo says closed or reset
    assert len(fixed["replica-lost"].ranks[0]["losses"]) == 15


def test_unscaled_learning_rate_converges_slower_and_the_command_says_what_it_found(fixed, capsys):
    broken = run_fault("lr-not-scaled")
    assert (broken.ranks[0]["record"]["lr"], fixed["lr-not-scaled"].ranks[0]["record"]["lr"]) == (0.05, 0.1)
    assert last_epoch_loss(broken, 8) > last_epoch_loss(fixed["lr-not-scaled"], 8) + 0.1
    assert main(["faults", "run", "no-set-epoch"]) == 1  # the command prints the findings and exits 1
    assert "labkit: found: rank 0 saw its 256 samples in the same order" in capsys.readouterr().out


def test_checker_rejects_the_untouched_program_and_accepts_the_fix(tmp_path, capsys):
    for name, wrong in (("unsynced-init", "replicas differ"), ("send-recv-deadlock", "it still hangs"),
                        ("lr-not-scaled", "other weights than the fixed version"),
                        ("unsynced-timing", "without torch.cuda.synchronize()")):
        untouched, fix = tmp_path / f"{name}.py", tmp_path / f"{name}_fixed.py"
        assert run_check(f"faults-{name}", ["--init", str(untouched)]) == 0
        fix.write_text(faults.fixed_source(name))
        assert run_check(f"faults-{name}", [str(untouched), "--watchdog", "3"]) == 1
        assert wrong in capsys.readouterr().out, name
        assert run_check(f"faults-{name}", [str(fix), "--watchdog", "3"]) == 0
        assert capsys.readouterr().out.startswith("correct:"), name
    # a plausible wrong fix of uneven-inputs, the final barrier removed: the mistake is named before gloo's error
    no_barrier = tmp_path / "uneven_no_barrier.py"
    text = faults.broken_source("uneven-inputs")
    assert text.count("    dist.barrier()") == 1
    no_barrier.write_text(text.replace("    dist.barrier()", "    pass"))
    assert run_check("faults-uneven-inputs", [str(no_barrier), "--watchdog", "3"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("not yet: rank 0 was still waiting in a collective when rank(s) 1 had finished and closed "
                          "their connections: the ranks ran different numbers of collectives"), out
    assert "The fix makes the counts equal: drop_last=True on the DataLoader" in out


def test_the_rank_that_failed_first_is_named_not_the_lowest_numbered():
    """Rank 1 fails first, in three ways, while rank 0 waits in a collective, which then fails on its vanished peer:
    the report names rank 1 with its own error, then rank 0 after it."""
    program = Path(__file__).with_name("first_failure_program.py")
    ways = {"raise": "ValueError: rank 1 read a batch of the wrong shape",
            "unused": "This error indicates that your module has parameters that were not used in producing loss",
            "dtype": "8 vs 4. Received data size doesn't match expected size. Is there a distributed collective "
                     "mismatch in your code? (killed by signal SIGABRT in first_failure_program.py:43, without a "
                     "Python exception)"}
    runs = {way: run_program(program, 2, env={"LABKIT_FAIL": way}, timeout=120) for way in ways}
    for way, run in runs.items():
        assert (run.status, [f["rank"] for f in run.failures]) == ("failed", [1, 0]), (way, run.failures, run.logs)
        first, then = run.failure_report()
        assert first.startswith("rank 1 failed first, at ") and ways[way] in first, (way, first)
        assert then.startswith("then rank 0, ") and "by peer" in then, (way, then)
    assert 'first_failure_program.py", line 36, in main' in runs["raise"].error  # the traceback shown is rank 1's


def test_a_peer_waiting_outside_any_collective_is_stopped_soon_after_the_first_failure(monkeypatch):
    """Rank 1 dies before ``init_process_group``; rank 0 waits there for it, where the watchdog does not look. The
    runner stops rank 0 ``AFTER_FAILURE_S`` after rank 1's failure, not at its own timeout, and says why."""
    from labkit.faults import runner

    monkeypatch.setattr(runner, "AFTER_FAILURE_S", 2.0)
    run = run_program(Path(__file__).with_name("first_failure_program.py"), 2, env={"LABKIT_FAIL": "before-init"},
                      timeout=120)
    assert (run.status, [f["rank"] for f in run.failures]) == ("failed", [1, 0]), run.failures
    assert "ValueError: rank 1 failed before init_process_group" in run.failures[0]["message"]
    assert "still running 2 s after rank 1 failed" in run.failures[1]["message"], run.failures[1]


def test_failure_report_reads_plain_failures():
    outcome = Outcome("failed", failures=[
        {"rank": 1, "time": 1795931451.825, "message": "ValueError: bad batch", "error": ""},
        {"rank": 0, "time": 1795931451.862, "message": "RuntimeError: Connection closed by peer", "error": ""}])
    assert outcome.failure_report() == ["rank 1 failed first, at 05:50:51.825 UTC: ValueError: bad batch",
                                        "then rank 0, 0.037 s later: RuntimeError: Connection closed by peer"]


def test_table_reads_plain_reports():
    reports = [{"rank": 0, "current": {"op": "all_reduce", "seq": 17, "shape": [10], "dtype": "float32"},
                "completed": [{"op": "all_reduce", "seq": 16}], "where": "a.py:3 dist.all_reduce(t)"},
               {"rank": 1, "current": None, "completed": [], "where": "a.py:9 time.sleep(60)"}]
    text = hang_table(reports, 3, 5)
    assert ("rank 0 is in all_reduce #17 of shape (10,) float32, rank 1 is in no collective, "
            "rank 2 did not report") in text
    assert text.splitlines()[2].split()[:3] == ["0", "all_reduce", "#17"]


def test_a_rank_waits_in_its_own_collective_not_in_the_kits_bookkeeping():
    check = {"op": "all_reduce", "seq": 12, "shape": [2], "dtype": "float64", "done": False,
             "kit": "labkit's stop check"}
    grads = {"op": "all_reduce", "seq": 13, "shape": [669706], "dtype": "float32", "done": False}
    assert waiting_in([{**check, "seq": 10, "done": True}, check, grads]) == grads
    assert waiting_in([check]) == check and waiting_in([{**grads, "done": True}]) is None
    assert describe(check) == "all_reduce #12 of shape (2,) float64 (labkit's stop check)"


@pytest.mark.parametrize("argv, message", [
    (["faults", "run", "uneven-inputs", "--ranks", "1"], "--ranks must be between 2 and 8"),
    (["faults", "run", "send-recv-deadlock", "--ranks", "3"], "--ranks must be even"),
    (["faults", "run", "nan-spreads", "--device", "cuda"], "--device cuda is for unsynced-timing"),
    (["check", "faults-nan-spreads", "missing.py"], "no such file 'missing.py'"),
    (["train", "--watchdog", "2000", "--device", "cpu"], "--watchdog must be 0 (off) or between 0 and --timeout-s"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error: ") and message in err[0], err


def test_list_and_watchdog_settings(capsys, monkeypatch):
    assert main(["faults", "list"]) == 0
    assert capsys.readouterr().out.count("\n") == 2 * 11
    monkeypatch.setenv("LABKIT_WATCHDOG", "0")
    assert start_for_training(None, 1800) is None and start_for_training(0, 1800) is None


def test_labkit_train_watchdog_ends_a_hung_ddp_job_with_the_table(tmp_path):
    """`labkit train --watchdog 3` (the flag every job can set): rank 1 stops in its third optimizer step, rank 0
    waits in DDP's gradient all-reduce, which DDP issues from C++ and the flight recorder still sees; the stop
    check's all-reduce rank 0 has in flight meanwhile (#12) is not what it waits in."""
    run = run_program(Path(__file__).with_name("train_hang_program.py"), 2, watchdog=None,
                      env={"LABKIT_TEST_OUT": str(tmp_path)}, timeout=120)
    table = run.logs[0]
    # one bucket of all 669706 gradients of the mlp (2.7 MB, under DDP's 25 MB bucket cap); a stop check after
    # every step (0.3 s each): #10 the check after step 2, #11 step 3's gradients, #12 rank 0's next check
    assert "rank 0 is in all_reduce #13 of shape (669706,) float32, rank 1 is in no collective" in table
    assert "all_reduce #10 (labkit's stop check), all_reduce #11  " in table
    assert "train_hang_program.py:19 time.sleep(600)" in table and "ddp.py" in table

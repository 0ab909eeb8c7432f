"""A rank that dies with no restarts left: the surviving rank stops with one clear error (exit 2) instead of
waiting. (A rank SIGKILLed under ``torchrun --max-restarts 1``, restarted and resumed bit-identically, is in
tests/test_preempt.py, in the same run as a SIGTERM mid-epoch.)
"""
from labkit.dist.testing import run_cli_ranks

# 96 samples, 2 ranks × 8 per rank: 6 steps per epoch; rank 1 dies before step 2
TRAIN = ["train", "--strategy", "ddp", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "96",
         "--test-size", "64", "--batch-size", "8", "--epochs", "1", "--base-lr", "0.05", "--device", "cpu",
         "--seed", "3", "--log-every", "100"]


def test_dead_rank_without_restarts_stops_the_others_with_a_clear_error(tmp_path):
    """Two ranks started without torchrun (as srun would: each with its RANK, WORLD_SIZE, MASTER_ADDR; forked
    here, running the ``labkit`` command's main): rank 1 dies, rank 0 must not wait for it."""
    timeout_s = 20
    (killed, _, _), (code, _, err) = reversed(run_cli_ranks(
        [*TRAIN, "--out", str(tmp_path / "run"), "--kill-rank-at", "1:2", "--timeout-s", str(timeout_s),
         "--no-checkpoint"], 2, timeout=timeout_s + 60))  # a rank 0 left waiting fails here
    assert killed == -9  # SIGKILL
    assert code == 2, err
    errors = [ln for ln in err.splitlines() if ln.startswith("labkit: error:")]
    assert len(errors) == 1, err
    assert "rank 0: the gradient all-reduce in backward failed at step 2: another rank died or stalled" in errors[0]
    assert "--resume" in errors[0]

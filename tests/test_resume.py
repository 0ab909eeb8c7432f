"""A rank that dies with no restarts left: the surviving rank stops with one clear error (exit 2) instead of
waiting. (A rank SIGKILLed under ``torchrun --max-restarts 1``, restarted and resumed bit-identically, is in
tests/test_preempt.py, in the same run as a SIGTERM mid-epoch.)
"""
import os
import subprocess
import sys

from labkit.testing import free_port

# 96 samples, 2 ranks × 8 per rank: 6 steps per epoch; rank 1 dies before step 2
TRAIN = ["train", "--strategy", "ddp", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "96",
         "--test-size", "64", "--batch-size", "8", "--epochs", "1", "--base-lr", "0.05", "--device", "cpu",
         "--seed", "3", "--log-every", "100"]


def test_dead_rank_without_restarts_stops_the_others_with_a_clear_error(tmp_path):
    """Two ranks started by hand (as srun would): rank 1 dies, rank 0 must not wait for it."""
    timeout_s = 20
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "labkit", *TRAIN, "--out", str(tmp_path / "run"), "--kill-rank-at", "1:2",
               "--timeout-s", str(timeout_s), "--no-checkpoint"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        procs[1].wait(timeout=240)
        _, err = procs[0].communicate(timeout=timeout_s + 60)  # a rank 0 left waiting fails here
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -9  # SIGKILL
    assert procs[0].returncode == 2, err
    errors = [ln for ln in err.splitlines() if ln.startswith("labkit: error:")]
    assert len(errors) == 1, err
    assert "rank 0: the gradient all-reduce in backward failed at step 2: another rank died or stalled" in errors[0]
    assert "--resume" in errors[0]

"""Fault tolerance of `labkit train --strategy ddp` under torchrun (CPU, gloo, deterministic).

1. A rank SIGKILLed mid-epoch under ``torchrun --max-restarts 1`` is restarted with the whole group, which
   resumes from the last per-epoch checkpoint and ends bit-identical (torch.equal) to an uninterrupted run.
2. With no restarts left, the surviving rank stops with one clear error (exit 2) instead of waiting.
"""
import json
import os
import subprocess
import sys

import torch

from labkit.launch import torchrun
from labkit.testing import free_port
from labkit.train import load_checkpoint

# 96 samples, 2 ranks × 8 per rank: 6 steps per epoch; step 9 is the middle of epoch 2
TRAIN = ["train", "--strategy", "ddp", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "96",
         "--test-size", "64", "--batch-size", "8", "--epochs", "3", "--base-lr", "0.05", "--device", "cpu",
         "--seed", "3", "--log-every", "100"]


def test_killed_rank_is_restarted_and_resumes_bit_identically(tmp_path):
    lines = []
    torchrun([*TRAIN, "--out", str(tmp_path / "clean")], nproc=2, echo=lines.append, timeout=300)
    torchrun([*TRAIN, "--out", str(tmp_path / "killed"), "--resume", "--kill-rank-at", "1:9"], nproc=2,
             max_restarts=1, echo=lines.append, timeout=300)
    log = "\n".join(lines)
    assert "rank 1: --kill-rank-at: SIGKILL before step 9" in log
    assert "resumed from" in log and "at epoch 1" in log  # the restart continued after epoch 1's checkpoint

    clean = load_checkpoint(tmp_path / "clean" / "checkpoint.pt")
    resumed = load_checkpoint(tmp_path / "killed" / "checkpoint.pt")
    assert clean["epoch"] == resumed["epoch"] == 3
    assert clean["model"].keys() == resumed["model"].keys()
    for name, tensor in clean["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    for i, state in clean["optimizer"]["state"].items():  # momentum buffers too
        assert torch.equal(state["momentum_buffer"], resumed["optimizer"]["state"][i]["momentum_buffer"])

    def epochs(run):
        return [json.loads(ln) for ln in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                if '"epoch"' in ln]
    assert [r["epoch"] for r in epochs("killed")] == [1, 2, 3]
    assert [r["train_loss"] for r in epochs("killed")] == [r["train_loss"] for r in epochs("clean")]


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

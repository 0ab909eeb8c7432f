"""Pre-emption on a real one-node SLURM cluster: ``jobs/job_ddp.sh`` gets SLURM's warning signal mid-epoch
(``scancel --signal=USR1 --batch``, what ``#SBATCH --signal=B:USR1@120`` sends before a time limit), its ranks
write a mid-epoch checkpoint, the job requeues itself, resumes from that step when it runs again, and ends with
the weights of the same job run uninterrupted (torch.equal). The two jobs run side by side (each asks for half the
test node), so the uninterrupted one trains while the warned one sleeps through its slowed steps and its requeue."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from labkit.checkpoint import load_checkpoint

from .jobs import JOB_MEMORY, JOBS, job_env
from .provision import REPO
from .slurm_cluster import TERMINAL, SlurmCluster

pytestmark = pytest.mark.system

# 2 CPU ranks × 16 samples: 12 steps per epoch, 2 epochs. The warned job is slowed down (which changes no result)
# so that the signal lands mid-epoch: it is sent at epoch 1's first throughput line (step 3) and must reach the
# ranks (scancel, slurmd, the script's trap, srun) 0.2 s plus two steps before the epoch's last step; the 9 steps
# left of 0.4 s leave it seconds even while the clean job computes beside it on a busy machine. The resumed run
# finishes epoch 1 from that step and then trains all of epoch 2, whose shuffle must not skip anything.
ARGS = ("--model mlp --dataset synthetic-mnist --train-size 384 --test-size 32 --batch-size 16 --epochs 2 "
        "--log-every 1 --seed 4")


def _submit(slurm: SlurmCluster, root: Path, name: str, extra: str = ""):
    env = job_env(root / name) | {"NPROC": "2", "EXTRA_ARGS": f"{ARGS} {extra}"}
    return slurm.submit(JOBS / "job_ddp.sh", name=name, output=root / f"{name}.log", env=env,
                        args=(JOB_MEMORY, "--time=5", "--open-mode=append"), cwd=REPO)


def test_warned_job_checkpoints_requeues_and_ends_bit_identical(slurm: SlurmCluster, tmp_path: Path) -> None:
    clean = _submit(slurm, tmp_path, "clean")
    warned = _submit(slurm, tmp_path, "warned", "--step-delay-s 0.4")
    deadline = time.monotonic() + 300
    while "train | 1/2 epoch" not in warned.log():  # epoch 1 under way
        assert time.monotonic() < deadline and slurm.refresh(warned).state not in TERMINAL, warned.describe()
        time.sleep(0.3)
    slurm.command("scancel", "--signal=USR1", "--batch", warned.job_id)
    assert slurm.wait([clean], 300) and slurm.wait([warned], 400, frozenset({"COMPLETED", "FAILED", "CANCELLED",
                                                                               "TIMEOUT"})), warned.describe()
    assert clean.state == "COMPLETED" and warned.state == "COMPLETED", warned.describe()
    assert int(warned.info.get("Restarts", "0")) == 1, warned.describe()

    log = warned.log()
    assert "labkit: stopped on SIGTERM in epoch 1 after step" in log and f"requeued job {warned.job_id}" in log, log
    stopped_at = int(log.split("in epoch 1 after step ")[1].split(";")[0])
    assert 0 < stopped_at < 12 and f"at epoch 0, step {stopped_at}" in log, log
    a = load_checkpoint(tmp_path / "clean" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "warned" / "checkpoint.pt")
    assert a["epoch"] == b["epoch"] == 2
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    summary = json.loads((tmp_path / "warned" / "summary.json").read_text())
    assert summary["metrics"]["final_train_loss"] == json.loads(
        (tmp_path / "clean" / "summary.json").read_text())["metrics"]["final_train_loss"]

"""Pre-emption on a real SLURM cluster: ``jobs/job_ddp.sh`` gets SLURM's warning signal mid-epoch
(``scancel --signal=USR1 --batch``, what ``#SBATCH --signal=B:USR1@120`` sends before a time limit), its ranks
write a mid-epoch checkpoint, the job requeues itself, resumes from that step when it runs again, and ends with
the weights of the same job run uninterrupted (torch.equal): the batch's ``job_ddp``, submitted with the same
arguments (``tests/system/batch.py``, where the warned job is slowed down so that the warning lands mid-epoch)."""

from __future__ import annotations

import json

import pytest
import torch

from labkit.train.checkpoint import load_checkpoint

from .batch import BATCH_TIMEOUT_S, WARNED, Batch

pytestmark = pytest.mark.system


@pytest.mark.timeout(BATCH_TIMEOUT_S + 120)  # the first test may wait for the whole batch
def test_warned_job_checkpoints_requeues_and_ends_bit_identical(slurm_batch: Batch) -> None:
    (clean, clean_out), (warned, warned_out) = slurm_batch["job_ddp"], slurm_batch[WARNED]
    assert slurm_batch.warned_signalled, f"epoch 1 never began:\n{warned.describe()}"
    assert clean.state == "COMPLETED" and warned.state == "COMPLETED", warned.describe()
    assert int(warned.info.get("Restarts", "0")) == 1, warned.describe()

    # the output file keeps both attempts' lines (the script's --open-mode=append; the batch does not add it): the
    # first's banner, stop and requeue, then the second's banner and resume
    log = warned.log()
    assert "labkit: stopped on SIGTERM in epoch 1 after step" in log and f"requeued job {warned.job_id}" in log, log
    stopped_at = int(log.split("in epoch 1 after step ")[1].split(";")[0])
    resumed = f"checkpoint.pt in epoch 1 after step {stopped_at}\n"  # the resume line, in the stop line's words
    assert 0 < stopped_at < 12 and resumed in log, log
    assert log.count("labkit train | mlp on synthetic-mnist") == 2, log
    assert log.index(f"requeued job {warned.job_id}") < log.index(resumed), log
    a = load_checkpoint(clean_out / "checkpoint.pt")
    b = load_checkpoint(warned_out / "checkpoint.pt")
    assert a["epoch"] == b["epoch"] == 2
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    summary, clean_summary = (json.loads((out / "summary.json").read_text()) for out in (warned_out, clean_out))
    assert summary["metrics"]["final_train_loss"] == clean_summary["metrics"]["final_train_loss"]
    # the attempts: the first stopped on SIGTERM (what the script sends the ranks on the warning) mid-epoch 1, the
    # second resumed there and finished; the epochs of both count
    assert [{k: a[k] for k in ("resumed_at", "signal", "stopped_at")} for a in summary["attempts"]] == [
        {"resumed_at": None, "signal": "SIGTERM", "stopped_at": {"epoch": 0, "step": stopped_at}},
        {"resumed_at": {"epoch": 0, "step": stopped_at}, "signal": None, "stopped_at": None}], summary["attempts"]
    assert summary["metrics"]["epochs_run"] == clean_summary["metrics"]["epochs_run"] == 2
    assert [a["resumed_at"] for a in clean_summary["attempts"]] == [None]

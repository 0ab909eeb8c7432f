"""Pre-emption without SLURM: a stop signal (SIGUSR1: SLURM's warning; SIGTERM: scancel, pre-emption, time limit,
forwarded by torchrun) mid-epoch → the step finishes, a mid-epoch checkpoint is written, the run exits 75 with
``preempted.json``; ``--resume`` continues from that step and ends bit-identical to an uninterrupted run.
The SLURM round trip (job script trap, requeue) is in tests/system/test_slurm_preempt.py."""
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from labkit import train as ktrain
from labkit.cli import main
from labkit.preempt import EXIT_PREEMPTED, MARKER, StopSignals
from labkit.train import TrainConfig, load_checkpoint

# 96 samples in batches of 16: 6 steps per epoch
SMALL = dict(model="mlp", dataset="synthetic-mnist", train_size=96, test_size=32, batch_size=16, epochs=3,
             device="cpu", log_every=100, seed=5)


def test_stop_signals_record_the_signal_and_restore_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to the main thread before the next bytecode
        assert stop.received == "SIGUSR1" and stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is recorded, not fatal
        assert stop.received == "SIGTERM"
    assert signal.getsignal(signal.SIGUSR1) is before


def _equal_runs(clean, resumed, checkpoint="checkpoint.pt"):
    a, b = load_checkpoint(clean / checkpoint), load_checkpoint(resumed / checkpoint)
    assert a["epoch"] == b["epoch"] and a["position"] is None and b["position"] is None
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for i, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])

    def losses(run):
        return [json.loads(ln)["train_loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()
                if '"kind": "epoch"' in ln]
    assert losses(clean) == losses(resumed) and len(losses(clean)) == 3


def test_signal_mid_epoch_with_kfac_resumes_bit_identically(tmp_path, monkeypatch, capsys, one_thread):
    """One process, K-FAC updating every step: SIGUSR1 arrives during step 3 of epoch 2 (from the per-step
    sleep hook), the step finishes, the checkpoint holds step 3 and K-FAC's factors."""
    kfac = dict(optimizer="kfac", optim_options={"kfac_update_freq": 1}, step_delay_s=1e-6)
    ktrain.run(TrainConfig(**SMALL, **kfac, out=str(tmp_path / "clean")))
    steps = []

    def sleep(_):
        steps.append(None)
        if len(steps) == 6 + 3:
            os.kill(os.getpid(), signal.SIGUSR1)
    monkeypatch.setattr(ktrain, "time", types.SimpleNamespace(sleep=sleep, perf_counter=time.perf_counter))
    args = ["train", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "96", "--test-size", "32",
            "--batch-size", "16", "--epochs", "3", "--device", "cpu", "--log-every", "100", "--seed", "5",
            "--optimizer", "kfac", "--kfac-update-freq", "1", "--step-delay-s", "1e-6", "--out", str(tmp_path / "int")]
    assert main(args) == EXIT_PREEMPTED
    err = capsys.readouterr().err
    assert "labkit: stopped on SIGUSR1 in epoch 2 after step 3" in err and "--resume" in err
    assert json.loads((tmp_path / "int" / MARKER).read_text()) == {"epoch": 1, "step": 3, "signal": "SIGUSR1"}
    saved = load_checkpoint(tmp_path / "int" / "checkpoint.pt")
    assert saved["epoch"] == 1 and saved["position"]["step"] == 3 and saved["preconditioner"]["steps"] == 9

    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert not (tmp_path / "int" / MARKER).exists()
    _equal_runs(tmp_path / "clean", tmp_path / "int")


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_sigterm_to_torchrun_mid_epoch_resumes_bit_identically(tmp_path, strategy):
    """torchrun forwards SIGTERM to both ranks; they stop after the same step (a non-replicated strategy
    writes one checkpoint per rank)."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "labkit",
            "train", "--strategy", strategy, *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()],
            "--train-size", "192", "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", LABKIT_PLAIN="1", PYTHONUNBUFFERED="1")
    subprocess.run([*args, "--out", str(tmp_path / "clean")], env=env, check=True, capture_output=True, timeout=300)
    # slowed down (the delay changes no result) so that the signal lands mid-epoch
    proc = subprocess.Popen([*args, "--out", str(tmp_path / "int"), "--step-delay-s", "0.15"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = []
        for line in proc.stdout:
            log.append(line)
            if line.startswith("train | 2/3 epoch"):  # epoch 2 under way (a line per step)
                proc.send_signal(signal.SIGTERM)
                break
        log += proc.stdout.readlines()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(log)
    marker = json.loads((tmp_path / "int" / MARKER).read_text())
    assert marker["epoch"] == 1 and 0 < marker["step"] < 6 and marker["signal"] == "SIGTERM", text
    assert text.count("labkit: stopped on SIGTERM") == 1, text
    resumed = subprocess.run([*args, "--out", str(tmp_path / "int"), "--resume"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:]
    assert f"at epoch 1, step {marker['step']}" in resumed.stdout
    for name in ["checkpoint.pt"] if strategy == "ddp" else ["checkpoint.rank0.pt", "checkpoint.rank1.pt"]:
        _equal_runs(tmp_path / "clean", tmp_path / "int", name)

"""Pre-emption without SLURM: a stop signal (SIGUSR1: SLURM's warning; SIGTERM: scancel, pre-emption, time limit,
forwarded by torchrun) mid-epoch → the step finishes, a mid-epoch checkpoint is written, the run exits 75 with
``preempted.json``; ``--resume`` continues from that step and ends bit-identical to an uninterrupted run.
Under torchrun, a rank killed outright is restarted with the whole group (``--max-restarts``), which resumes
from the last checkpoint. The SLURM round trip (job script trap, requeue) is in tests/system/test_slurm_preempt.py."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import psutil
import pytest
import torch

from labkit.cli import main
from labkit.dist.testing import run_cli_ranks, run_ranks
from labkit.train import loop as ktrain
from labkit.train import run as train_run
from labkit.train.checkpoint import load_checkpoint
from labkit.train.config import TrainConfig
from labkit.train.preempt import EXIT_PREEMPTED, MARKER, StopSignals, attempts
from labkit.train.run import run

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


def test_attempts_pair_each_start_with_its_stop_and_note_one_that_ended_without():
    records = [{"kind": "attempt", "event": "start", "time": "T1", "resumed_at": None},
               {"kind": "attempt", "event": "stop", "time": "T2", "signal": "SIGTERM",
                "stopped_at": {"epoch": 0, "step": 5}},
               {"kind": "attempt", "event": "start", "time": "T3", "resumed_at": {"epoch": 0, "step": 5}},
               {"kind": "attempt", "event": "start", "time": "T4", "resumed_at": {"epoch": 0, "step": 5}}]
    assert attempts(records, finished="T5") == [
        {"started": "T1", "resumed_at": None, "ended": "T2", "signal": "SIGTERM", "stopped_at": {"epoch": 0, "step": 5}},
        {"started": "T3", "resumed_at": {"epoch": 0, "step": 5}, "ended": None, "signal": None, "stopped_at": None},
        {"started": "T4", "resumed_at": {"epoch": 0, "step": 5}, "ended": "T5", "signal": None, "stopped_at": None}]


def test_signal_mid_epoch_with_kfac_resumes_bit_identically(tmp_path, monkeypatch, capsys, one_thread):
    """One process, K-FAC updating its factors and decompositions every 4 steps (global steps 0, 4, 8, ...):
    SIGUSR1 arrives during step 3 of epoch 2 (global step 8, from the per-step sleep hook), the step finishes, the
    checkpoint holds step 3 and K-FAC's state, and the resumed step 9 preconditions with what was restored. LeNet:
    its factors are at most 401 wide (the mlp's 785 made this test's eigendecompositions eight times dearer)."""
    kfac = dict(optimizer="kfac", optim_options={"kfac_update_freq": 4}, step_delay_s=1e-6)
    run(TrainConfig(**{**SMALL, "model": "lenet"}, **kfac, out=str(tmp_path / "clean")))
    steps = []

    def sleep(_):
        steps.append(None)
        if len(steps) == 6 + 3:
            os.kill(os.getpid(), signal.SIGUSR1)
    monkeypatch.setattr(ktrain, "time", types.SimpleNamespace(sleep=sleep, perf_counter=time.perf_counter))
    args = ["train", "--model", "lenet", "--dataset", "synthetic-mnist", "--train-size", "96", "--test-size", "32",
            "--batch-size", "16", "--epochs", "3", "--device", "cpu", "--log-every", "100", "--seed", "5",
            "--optimizer", "kfac", "--kfac-update-freq", "4", "--step-delay-s", "1e-6", "--out", str(tmp_path / "int")]
    assert main(args) == EXIT_PREEMPTED
    err = capsys.readouterr().err
    assert "labkit: stopped on SIGUSR1 in epoch 2 after step 3" in err and "--resume" in err
    assert json.loads((tmp_path / "int" / MARKER).read_text()) == {"epoch": 1, "step": 3, "signal": "SIGUSR1"}
    saved = load_checkpoint(tmp_path / "int" / "checkpoint.pt")
    assert saved["epoch"] == 1 and saved["position"]["step"] == 3 and saved["preconditioner"]["steps"] == 9

    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'int' / 'checkpoint.pt'} in epoch 2 after step 3\n" in out  # the stop's words
    lines = [ln for ln in out.splitlines() if ln.startswith("train | epoch 2/3")]  # the resumed epoch's
    assert lines[0].startswith("train | epoch 2/3 (66%)") and lines[-1].startswith("train | epoch 2/3 (100%)"), lines
    assert all(float(line.split(" | ")[2].split()[0]) > 0 for line in lines), lines
    assert not (tmp_path / "int" / MARKER).exists()
    _equal_runs(tmp_path / "clean", tmp_path / "int")
    summary = json.loads((tmp_path / "int" / "summary.json").read_text())
    assert summary["metrics"]["epochs_run"] == 3  # over both attempts
    tries = summary["attempts"]
    assert [{k: v for k, v in a.items() if k not in ("started", "ended")} for a in tries] == [
        {"resumed_at": None, "signal": "SIGUSR1", "stopped_at": {"epoch": 1, "step": 3}},
        {"resumed_at": {"epoch": 1, "step": 3}, "signal": None, "stopped_at": None}]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", a[k]) for a in tries for k in ("started", "ended"))


TRAIN_SIZE = {"ddp": 192, "pipeline": 96}


def _args(strategy, out, *extra):
    """``labkit train`` of SMALL in batches of 16 with 2 ranks, 6 steps per epoch (DDP: 2 × 16 per step on 192
    samples; the pipeline: one pipeline, the whole batch per step, on 96)."""
    return ["train", "--strategy", strategy, *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()],
            "--train-size", str(TRAIN_SIZE[strategy]), "--log-every", "1", "--out", str(out), *extra]


def _train(strategy, out, *extra, restarts=0):
    """:func:`_args` under torchrun with 2 ranks."""
    return [sys.executable, "-m", "labkit.dist.torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts",
            str(restarts), "-m", "labkit", *_args(strategy, out, *extra)]


def _clean_rank(env, root):
    """In the group run_ranks started: the uninterrupted runs of ``_train``'s configuration (DDP and the pipeline)
    the interrupted ones must end equal to, one after the other in the same two ranks."""
    from labkit.dist.group import seed_everything

    def same_group(*args, seed=0, **kwargs):
        seed_everything(seed)
        return contextlib.nullcontext(env)

    train_run.distributed = same_group
    for strategy in ("ddp", "pipeline"):
        train_run.run(TrainConfig(**{**SMALL, "train_size": TRAIN_SIZE[strategy], "log_every": 1}, strategy=strategy,
                                  out=f"{root}/{strategy}"))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted runs on two ranks forked from one process that imported torch once (two torchrun launches
    would start and import six processes): ``clean / "ddp"``, ``clean / "pipeline"``."""
    root = tmp_path_factory.mktemp("clean")
    run_ranks(_clean_rank, 2, str(root), timeout=300)
    return root


ENV = dict(os.environ, OMP_NUM_THREADS="1", LABKIT_PLAIN="1", PYTHONUNBUFFERED="1",
           TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # a fresh rendezvous store for a restarted group


def _signal_when(cmd, line_start, sig, only_rank=None, lines=1):
    """Run ``cmd``; at the ``lines``-th line starting with ``line_start`` send ``sig`` to torchrun (which passes
    it on to its ranks) or, with ``only_rank``, to that rank alone. Returns (exit code, the whole output, the
    ranks' process ids at the signal)."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, ranks, seen = [], [], 0
        for line in proc.stdout:
            log.append(line)
            seen += line.startswith(line_start)
            if seen == lines:
                ranks = psutil.Process(proc.pid).children()
                target = proc.pid if only_rank is None else next(
                    p.pid for p in ranks if p.environ().get("RANK") == str(only_rank))
                os.kill(target, sig)
                break
        log += proc.stdout.readlines()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # a test that failed or timed out: its ranks too, not only torchrun
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(log), [p.pid for p in ranks]


def _none_alive(pids):
    """No process of ``pids`` is left (a rank orphaned by its torchrun would still train under init)."""
    alive = []
    for pid in pids:
        try:
            alive += [pid] if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE else []
        except psutil.NoSuchProcess:
            pass
    return not alive


def _stopped_and_resumed(strategy, out, log, steps, sig="SIGTERM"):
    """The signal stopped the run mid-epoch 3 with one message; ``--resume`` continues from that step and the
    resumed epoch's throughput line counts from there (100 % at its end, a real rate). The resumed run is the
    ``labkit`` command on two ranks forked from a process that imported torch once: torchrun's part, the stop,
    is over (a third torchrun launch would import torch in three more processes)."""
    marker = json.loads((out / MARKER).read_text())
    assert marker["epoch"] == 2 and 0 < marker["step"] < steps and marker["signal"] == sig, log
    assert log.count("labkit: stopped on") == 1 and log.count(f"labkit: stopped on {sig}") == 1, log
    ranks = run_cli_ranks([*_args(strategy, out), "--resume"], 2, timeout=300)
    stdout = "".join(rank_out for _, rank_out, _ in ranks)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    resumed = f" in epoch 3 after step {marker['step']}"  # the stop's words
    assert any(ln.startswith(f"resumed from {out}") and ln.endswith(resumed) for ln in stdout.splitlines()), stdout
    lines = [ln for ln in stdout.splitlines() if ln.startswith("train | epoch 3/3")]
    done = [int(ln.split("(")[1].split("%")[0]) for ln in lines]
    assert 100 * marker["step"] // steps < done[0] and done == sorted(done) and done[-1] == 100, lines
    assert all(float(line.split(" | ")[2].split()[0]) > 0 for line in lines), lines


def test_ddp_killed_rank_restarts_then_sigterm_mid_epoch_resumes_bit_identically(tmp_path, clean):
    """One DDP run meets both failures. Rank 1 is SIGKILLed in epoch 2 under ``--max-restarts 1``: torchrun
    restarts the whole group, which resumes from epoch 1's checkpoint. In epoch 3 rank 1 alone gets SIGTERM (srun
    or a site wrapper signalling processes one by one); both ranks stop after the same step, rank 0 writes the
    mid-epoch checkpoint and a marker naming rank 1's signal, and the run exits 75 with one line.
    ``--resume`` finishes it, equal to an uninterrupted run (weights, momentum, every epoch's loss)."""
    # slowed down (the delay changes no result) so that the signal lands mid-epoch: epoch 3's first line comes
    # after its third step of six, and the last stop check is launched after the fourth, so the signal has about
    # two delays to arrive on a loaded machine
    code, log, _ = _signal_when(_train("ddp", tmp_path / "int", "--resume", "--kill-rank-at", "1:8",
                                       "--step-delay-s", "0.3", restarts=1), "train | epoch 3/3", signal.SIGTERM,
                                only_rank=1)
    assert "rank 1: --kill-rank-at: SIGKILL before step 8" in log and "checkpoint.pt after epoch 1\n" in log, log
    assert code == EXIT_PREEMPTED and "Traceback" not in log, log
    _stopped_and_resumed("ddp", tmp_path / "int", log, steps=6)
    _equal_runs(clean / "ddp", tmp_path / "int")


def test_pipeline_sigusr1_to_torchrun_mid_epoch_resumes_bit_identically(tmp_path, clean):
    """A non-replicated strategy, every rank writing its own mid-epoch checkpoint of the same step, and SIGUSR1
    to torchrun itself (SLURM's ``--signal=USR1`` without ``B:``): torchrun passes it on, the ranks stop after
    the same step, and torchrun exits 75 with the ranks' one line; no rank is left running."""
    # torchrun passes the signal on: more time to arrive than in the DDP test, where it goes to rank 1 itself
    code, log, ranks = _signal_when(_train("pipeline", tmp_path / "int", "--step-delay-s", "0.4"),
                                    "train | epoch 3/3", signal.SIGUSR1)
    assert len(ranks) == 2 and _none_alive(ranks), ranks
    assert code == EXIT_PREEMPTED and "Traceback" not in log and "torchrun stopped" not in log, log
    assert "death signal" not in log, log  # torchrun's own shutdown line: the ranks had already left
    _stopped_and_resumed("pipeline", tmp_path / "int", log, steps=6, sig="SIGUSR1")
    for name in ["checkpoint.rank0.pt", "checkpoint.rank1.pt"]:
        _equal_runs(clean / "pipeline", tmp_path / "int", name)


RANK = """import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
print("ready", flush=True)
while not got:
    time.sleep(0.01)
sys.exit(75)
"""


def test_sigterm_to_torchrun_reaches_the_ranks_and_their_75_is_torchruns(tmp_path):
    """torchrun's own SIGTERM handling (stop the ranks under a deadline, exit 143) gives way to labkit's: the
    signal is passed on, torchrun waits for its ranks (which stand for labkit's: they exit 75) and exits 75."""
    (tmp_path / "rank.py").write_text(RANK)
    # signalled once both ranks hold their handler (a rank still starting would die of it: 143)
    code, log, ranks = _signal_when([sys.executable, "-m", "labkit.dist.torchrun", "--standalone", "--nproc-per-node", "2",
                                     str(tmp_path / "rank.py")], "ready", signal.SIGTERM, lines=2)
    assert code == EXIT_PREEMPTED and len(ranks) == 2 and _none_alive(ranks), log
    assert "Traceback" not in log and "torchrun stopped" not in log and "death signal" not in log, log

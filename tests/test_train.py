"""labkit.train.loop: the one loop — LR schedule, metrics, checkpoints, resume, divergence, profiling, config errors."""
import json
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from labkit.errors import CheckpointError, ConfigError
from labkit.train.checkpoint import load_checkpoint
from labkit.train.config import TrainConfig
from labkit.train.loop import TrainingDiverged, fit, lr_factor
from labkit.train.run import run


def small_cfg(tmp_path, **kw):
    base = dict(model="mlp", dataset="synthetic-mnist", epochs=2, batch_size=32, train_size=256, test_size=128,
                device="cpu", out=str(tmp_path / "run"), base_lr=0.05, log_every=4)
    base.update(kw)
    return TrainConfig(**base)


def test_lr_schedule_step_decay_and_warmup():
    steps = 10
    assert lr_factor(0, steps, [2, 4], 0.1, 0, 1) == 1
    assert lr_factor(19, steps, [2, 4], 0.1, 0, 1) == 1
    assert lr_factor(20, steps, [2, 4], 0.1, 0, 1) == pytest.approx(0.1)
    assert lr_factor(45, steps, [2, 4], 0.1, 0, 1) == pytest.approx(0.01)
    # warm-up over 2 epochs from 0.25 to 1, linear in steps
    assert lr_factor(0, steps, [], 0.1, 2, 0.25) == pytest.approx(0.25)
    assert lr_factor(10, steps, [], 0.1, 2, 0.25) == pytest.approx(0.625)
    assert lr_factor(20, steps, [], 0.1, 2, 0.25) == 1


def test_fit_records_match_a_manual_evaluation():
    torch.manual_seed(0)
    x = torch.randn(96, 5)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    history = fit(model, loader, loader, opt, epochs=3, printer=lambda s: None)
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    with torch.no_grad():
        out = model(x)
        assert history[-1]["test_loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-5)
        assert history[-1]["test_acc"] == pytest.approx((out.argmax(1) == y).float().mean().item())


def test_nan_loss_stops_with_a_clear_message():
    x = torch.full((8, 3), float("nan"))
    loader = DataLoader(TensorDataset(x, torch.zeros(8, dtype=torch.long)), batch_size=4)
    model = nn.Linear(3, 2)
    with pytest.raises(TrainingDiverged, match="loss became nan.*lower --base-lr"):
        fit(model, loader, None, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, log_every=1,
            printer=lambda s: None)


def test_run_writes_results_and_checkpoint(tmp_path, capsys):
    summary = run(small_cfg(tmp_path))
    out = capsys.readouterr().out
    assert "samples/sec (estimated)" in out and "CPU (process, all devices)" in out
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"summary.json", "metrics.jsonl", "checkpoint.pt"} <= files
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk == summary and summary["metrics"]["epochs_run"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert {r["kind"] for r in records} == {"attempt", "epoch", "utilisation"}  # the CPU use, sampled while training
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert summary["metrics"]["final_test_acc"] == epochs[-1]["test_acc"]
    # FLOPs and MFU: the MLP's forward MACs 784·512 + 512·512 + 512·10 = 668,672; counted 6·668,672 less fc1's input
    # gradient 2·784·512 = 3,209,216 per sample (tests/test_flops.py works LeNet and the GPT through)
    flops = summary["metrics"]["flops"]
    assert (flops["model_per_sample"], flops["formula_per_sample"], flops["model_per_step"]) == (
        3_209_216, 4_012_032, 32 * 3_209_216)
    assert summary["metrics"]["mfu"] == summary["metrics"]["hfu"] == epochs[-1]["mfu"] > 0
    assert flops["peak_precision"] == "fp32" and "matmul measured at" in flops["peak_source"]
    assert re.search(r"^FLOPs \| 3\.21 MFLOP per sample counted, 4\.01 MFLOP by formula \| peak [\d.]+ [GMT]FLOP/s fp32 "
                     r"\([0-9x]+ matmul measured at \d+ threads?, cached in ", out, re.M)
    assert re.search(r"^epoch 2/2 \| train loss .* \| lr [\d.]+ \| MFU [\d.]+%, HFU [\d.]+%$", out, re.M)


def test_resume_continues_bit_identically(tmp_path):
    run(small_cfg(tmp_path, out=str(tmp_path / "straight"), epochs=3, lr_decay=[2], warmup_epochs=1))
    run(small_cfg(tmp_path, out=str(tmp_path / "resumed"), epochs=1, lr_decay=[2], warmup_epochs=1))
    summary = run(small_cfg(tmp_path, out=str(tmp_path / "resumed"), epochs=3, lr_decay=[2], warmup_epochs=1,
                            resume=True))
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")
    assert a["epoch"] == b["epoch"] == 3 and summary["metrics"]["epochs_run"] == 3  # 1 + 2 over two attempts
    assert [t["resumed_at"] for t in summary["attempts"]] == [None, {"epoch": 1, "step": 0}]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt.*delete it or run without --resume"):
        run(small_cfg(tmp_path, resume=True))


def test_profile_writes_a_trace(tmp_path):
    run(small_cfg(tmp_path, epochs=1, profile=True))
    traces = list((tmp_path / "run" / "profile").glob("*.json*"))
    assert traces, "no profiler trace written"


@pytest.mark.parametrize("field, value, message", [
    ("batch_size", 0, "--batch-size must be >= 1, got 0"), ("epochs", -1, "--epochs must be >= 1, got -1"),
    ("base_lr", 0.0, "--base-lr must be > 0, got 0.0"), ("max_steps", 0, "--max-steps must be >= 1, got 0"),
])
def test_bad_config(tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=message):
        run(small_cfg(tmp_path, **{field: value}))


def test_bad_names_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown strategy 'warp'"):
        run(small_cfg(tmp_path, strategy="warp"))
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        run(small_cfg(tmp_path, optimizer="lion"))


def test_one_progress_display(monkeypatch, capsys):
    """Plain output (notebooks, jobs): estimated lines then the epoch's 100 % line. In a terminal the estimates
    go to the progress bar instead, and only the epoch's line is printed."""
    import labkit.train.loop as train_module

    x, y = torch.randn(64, 5), torch.randint(0, 2, (64,))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lines = []
    fit(model, loader, None, opt, epochs=1, log_every=2, printer=lines.append)
    train = [line for line in lines if line.startswith("train |")]
    assert len(train) == 4 and all(line.endswith("(estimated)") for line in train[:-1])
    assert "epoch 1/1 (100%)" in train[-1] and not train[-1].endswith("(estimated)")

    monkeypatch.setattr(train_module, "interactive", lambda: True)
    lines = []
    fit(model, loader, None, opt, epochs=1, log_every=2, printer=lines.append)
    train = [line for line in lines if line.startswith("train |")]
    assert len(train) == 1 and "epoch 1/1 (100%)" in train[0]
    bar = capsys.readouterr().err
    assert "epoch 1/1:" in bar and "samples/" in bar  # the estimate, in the bar

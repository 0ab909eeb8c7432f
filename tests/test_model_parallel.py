"""Model parallelism in one process: split model == single-device model (output and every gradient), with and
without micro-batches; balancing; the recorded timeline and its projection (literal schedules); bad input;
`labkit train --strategy model-parallel`."""
from __future__ import annotations

import copy
import itertools
import json

import matplotlib
import pytest
import torch
from torch import nn

from labkit.cli import main as cli_main
from labkit.dist.group import DistEnv
from labkit.errors import ConfigError
from labkit.models.cnn import get_model
from labkit.strategies.model_parallel import (
    BusyInterval,
    ModelParallel,
    ModelParallelStrategy,
    project_on_separate_devices,
)
from labkit.strategies.stage_balance import balance_by_params, balance_from_split_points, partition
from labkit.viz.timeline import busy_fraction, plot_timeline

matplotlib.use("Agg")
ATOL = 1e-5  # float32: the same operations, micro-batches only change the order of the gradient sums


def _alexnet() -> nn.Sequential:
    torch.manual_seed(0)
    return get_model("alexnet_small", num_classes=10, in_channels=3, image_size=16, sequential=True)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    nn.functional.cross_entropy(out, y).backward()
    params = model.module.parameters() if isinstance(model, ModelParallel) else model.parameters()
    return out.detach(), [p.grad for p in params]


@pytest.mark.parametrize("balance, split_size, record", [
    ([3, 9, 7], None, False),     # explicit layers per stage, whole batch
    ("params", 3, True),          # balanced parameter counts, micro-batches 3 + 3 + 3 + 1, timeline on
    ("time", 4, False),           # balanced by measured time on the first batch
])
def test_model_parallel_equals_single_device(balance, split_size, record):
    reference = _alexnet()
    split = ModelParallel(copy.deepcopy(reference), ["cpu"] * 3, balance, split_size, record)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 3, 16, 16, generator=g), torch.randint(0, 10, (10,), generator=g)
    out_ref, grads_ref = _step(reference, x, y)
    out, grads = _step(split, x, y)
    assert torch.allclose(out, out_ref, atol=ATOL)
    assert len(grads) == len(grads_ref)
    for g_split, g_ref in zip(grads, grads_ref):
        assert torch.allclose(g_split, g_ref, atol=ATOL)
    assert sum(split.balance) == len(reference) and len(split.balance) == 3
    if record:
        timeline = split.timeline()
        assert len(timeline) == 3 * 4 * 2  # stages × micro-batches × (forward, backward)
        done = {(iv.stage, iv.micro_batch, iv.phase): iv for iv in timeline}
        for (stage, mb, phase), iv in done.items():
            assert iv.end >= iv.start
            if phase == "forward" and stage > 0:  # a stage waits for the previous stage's output
                assert iv.start >= done[stage - 1, mb, "forward"].end
            if phase == "backward" and stage < 2:  # ... and its gradient comes back from the next stage
                assert iv.start >= done[stage + 1, mb, "backward"].end
        assert set(busy_fraction(timeline)) == {0, 1, 2}
        ax = plot_timeline(timeline, title="measured")
        assert len(ax.collections) == len(timeline)  # one bar per interval


def _largest(costs, balance):
    bounds = [0, *itertools.accumulate(balance)]
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def test_partition_is_the_best_contiguous_split():
    g = torch.Generator().manual_seed(0)
    for n, stages in [(6, 2), (7, 3), (8, 4), (5, 5)]:
        costs = torch.randint(0, 50, (n,), generator=g).tolist()
        balance = partition(costs, stages)
        assert len(balance) == stages and min(balance) >= 1 and sum(balance) == n
        brute = min(_largest(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))])
                    for cuts in itertools.combinations(range(1, n), stages - 1))
        assert _largest(costs, balance) == brute, (costs, balance)
    assert partition([1, 2, 3, 4, 5, 6], 3) == [3, 2, 1]  # 6 | 9 | 6: the only split with largest sum 9
    model = _alexnet()
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model]
    assert _largest(counts, balance_by_params(model, 2)) == min(
        max(sum(counts[:k]), sum(counts[k:])) for k in range(1, len(model)))


def test_projection_is_the_pipeline_schedule():
    """2 stages, 3 micro-batches; forward 1 s each, backward 2 s each, measured one after another (CPU)."""
    measured, t = [], 0.0
    for mb in range(3):
        for stage in range(2):
            measured.append(BusyInterval(stage, "cpu", mb, "forward", t, t + 1))
            t += 1
    for mb in reversed(range(3)):
        for stage in reversed(range(2)):
            measured.append(BusyInterval(stage, "cpu", mb, "backward", t, t + 2))
            t += 2
    projected = {(iv.stage, iv.micro_batch, iv.phase): (iv.start, iv.end) for iv in project_on_separate_devices(measured)}
    assert projected == {
        (0, 0, "forward"): (0, 1), (1, 0, "forward"): (1, 2),
        (0, 1, "forward"): (1, 2), (1, 1, "forward"): (2, 3),
        (0, 2, "forward"): (2, 3), (1, 2, "forward"): (3, 4),
        (1, 2, "backward"): (4, 6), (0, 2, "backward"): (6, 8),
        (1, 1, "backward"): (6, 8), (0, 1, "backward"): (8, 10),
        (1, 0, "backward"): (8, 10), (0, 0, "backward"): (10, 12),
    }
    assert busy_fraction(measured) == {0: 9 / 18, 1: 9 / 18}  # one device at a time: half the time idle


def test_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"split point 19 is out of range: a model with 19 layers can be cut "
                                          r"before layer 1 \.\. 18"):
        balance_from_split_points(19, [5, 19])
    with pytest.raises(ConfigError, match=r"split point 0 is out of range"):
        balance_from_split_points(19, [0])
    with pytest.raises(ConfigError, match=r"split points \[9, 4\] must be strictly increasing"):
        balance_from_split_points(19, [9, 4])
    assert balance_from_split_points(6, [2, 5]) == [2, 3, 1]
    tiny = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="cannot split a model of 3 layers over 4 devices: .* at most 3 devices"):
        ModelParallel(tiny, ["cpu"] * 4)
    with pytest.raises(ConfigError, match="split-size must be > 0"):
        ModelParallel(tiny, ["cpu"] * 2, split_size=0)
    with pytest.raises(ConfigError, match=r"balance \[1, 1\] must give each of the 2 devices"):
        ModelParallel(tiny, ["cpu"] * 2, balance=[1, 1])
    with pytest.raises(ConfigError, match="cuts an nn.Sequential, got LeNet"):
        ModelParallel(get_model("lenet"), ["cpu"] * 2)
    with pytest.raises(ConfigError, match="from ONE process"):
        ModelParallelStrategy(DistEnv(world_size=2, distributed=True), {})
    with pytest.raises(ConfigError, match="--mp-devices 2 needs 2 GPUs but this node has"):
        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has 2 GPUs")
        ModelParallelStrategy(DistEnv(device=torch.device("cuda")), {"mp_devices": 2})
    with pytest.raises(ConfigError, match="split point 30 is out of range"):
        ModelParallelStrategy(DistEnv(), {"mp_split_points": [30]}).prepare(_alexnet())


def test_labkit_train_model_parallel(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["train", "--strategy", "model-parallel", "--mp-split-points", "4", "9", "--mp-split-size", "8",
                     "--model", "lenet", "--dataset", "mnist-sample", "--train-size", "64", "--test-size", "32",
                     "--batch-size", "16", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "samples/sec" in printed and "strategy model-parallel" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["strategy_options"]["mp_split_points"] == [4, 9]
    assert summary["metrics"]["samples_per_sec"] > 0 and summary["metrics"]["epochs_run"] == 1
    state = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    get_model("lenet", sequential=True).load_state_dict(state)  # the plain flat model's keys
    assert cli_main(["train", "--strategy", "model-parallel", "--mp-devices", "40", "--model", "lenet",
                     "--device", "cpu", "--out", str(tmp_path / "bad")]) == 2
    assert "cannot split a model of 12 layers over 40 devices" in capsys.readouterr().err


def test_split_size_sweep_writes_the_results_schema(tmp_path):
    from labkit.bench.model_parallel import plot_sweep, split_size_sweep
    from labkit.results import RunWriter, load_run

    writer = RunWriter(tmp_path)
    result = split_size_sweep("mlp", "mnist-sample", batch_size=16, split_sizes=[4, 16], steps=1, rounds=2,
                              device="cpu", writer=writer, progress=False)
    writer.finish("sweep", "bench", {}, {"samples_per_sec": result["rates"]["split 4"]})
    run = load_run(tmp_path)
    assert set(result["rates"]) == {"single", "naive", "split 4", "split 16"}
    assert len(run.records_of("bench")) == 2 * 4  # rounds × contenders
    traces = run.records_of("trace")
    assert {t["contender"] for t in traces} >= {"naive"} and all(t["end"] >= t["start"] for t in traces)
    assert len(plot_sweep(result).lines) == 3


class _RecordingLoss(nn.CrossEntropyLoss):
    """Cross-entropy that keeps every step's loss (fit calls it once per training step)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def forward(self, out, y):
        loss = super().forward(out, y)
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("split_size", [None, 4])
def test_fit_with_model_parallel_equals_single_process_fit(split_size):
    """Through labkit.train.loop.fit, the loop `labkit train` runs: LeNet cut before layers 4 and 9 over 3 devices
    (with and without micro-batches of 4) and the same LeNet on one device see the same loss at each of the
    2 × 4 steps and end with the same weights and momentum."""
    from torch.utils.data import DataLoader, TensorDataset

    from labkit.train.loop import fit

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g))
    torch.manual_seed(0)
    reference = get_model("lenet", sequential=True)
    split = copy.deepcopy(reference)
    strategy = ModelParallelStrategy(DistEnv(), {"mp_split_points": [4, 9], "mp_split_size": split_size})
    model = strategy.prepare(split)
    runs = []
    for net, kwargs in ((model, {"strategy": strategy}), (reference, {})):
        optimizer = torch.optim.SGD(strategy.unwrap(net).parameters() if net is model else net.parameters(),
                                    lr=0.05, momentum=0.9)
        loss = _RecordingLoss()
        fit(net, DataLoader(data, batch_size=8, shuffle=True), None, optimizer, epochs=2, criterion=loss, seed=3,
            printer=lambda line: None, **kwargs)
        runs.append((loss.losses, optimizer))
    (losses, optimizer), (ref_losses, ref_optimizer) = runs
    assert len(losses) == len(ref_losses) == 2 * 4 and strategy.unwrap(model) is split
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    for p, r in zip(split.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, atol=ATOL, rtol=0)
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], ref_optimizer.state[r]["momentum_buffer"],
                                   atol=ATOL, rtol=0)


def test_layer_times_are_measured_after_an_uncounted_warm_up(monkeypatch):
    """Cold passes put 60-90 % of alexnet_small's step on its first layer and the cut after it ([1, 18]):
    balance_by_time profiles only after a warm-up as long as the measurement, which is not counted."""
    from labkit.strategies import stage_balance

    calls = []

    def fake_profile(model, sample, timeout, device):
        calls.append(timeout)
        return [len(calls)] * len(model)

    monkeypatch.setattr(stage_balance, "profile_times", fake_profile)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert stage_balance.layer_times(net, torch.zeros(2, 4), timeout_s=0.5) == [2, 2, 2]
    assert calls == [0.5, 0.5]
    assert stage_balance.balance_by_time(net, torch.zeros(2, 4), 2) in ([1, 2], [2, 1])

"""labkit.bench: the shared harness, the plain baselines, the suite and the report from the committed references."""
import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from labkit.bench import harness
from labkit.bench.contenders import PlainLoop
from labkit.bench.report import PLOTS, load_suite, load_suites, render
from labkit.cli import main
from labkit.dist.testing import run_cli_ranks
from labkit.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")
REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference"


def test_alternate_warms_up_rotates_and_reports_medians_and_paired_ratios(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("labkit.bench.harness.time.perf_counter", lambda: now[0])
    calls = []
    seconds = {"a": [9.0, 1.0, 2.0, 1.0, 4.0], "b": [9.0, 2.0, 2.0, 4.0, 4.0]}  # first call: the warm-up

    def contender(name):
        def call():
            calls.append(name)
            now[0] += seconds[name][sum(c == name for c in calls) - 1]
            return 8
        return call

    results = harness.alternate({"a": contender("a"), "b": contender("b")}, rounds=4, devices=["cpu"])
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then AB, BA, AB, BA
    assert results.rates("a") == [8.0, 4.0, 8.0, 2.0] and results.rates("b") == [4.0, 4.0, 2.0, 2.0]
    summary = results.summary("b")
    assert summary["a"]["median_samples_per_sec"] == statistics.median([8.0, 4.0, 8.0, 2.0])
    assert summary["a"]["ratio"] == statistics.median([2.0, 1.0, 4.0, 1.0])
    assert (summary["a"]["ratio_min"], summary["a"]["ratio_max"]) == (1.0, 4.0)
    assert (summary["b"]["min_samples_per_sec"], summary["b"]["max_samples_per_sec"]) == (2.0, 4.0)
    assert "ratio" in results.table("b", 0.97)


def test_plain_loop_shards_one_permutation_and_trains():
    x, y = torch.randn(40, 3), torch.arange(40) % 2
    seen = [[], []]

    class Spy(torch.nn.Linear):
        def forward(self, inp):
            seen[rank].append(inp)
            return super().forward(inp)

    for rank in (0, 1):
        torch.manual_seed(0)
        assert PlainLoop(Spy(3, 2), x, y, batch_size=4, steps=5, rank=rank, world=2)() == 40
    rows = [torch.cat(s) for s in seen]
    matches = [(x[None] == r[:, None]).all(-1).nonzero()[:, 1] for r in rows]
    assert sorted(torch.cat(matches).tolist()) == list(range(40))  # disjoint shards covering everything
    with pytest.raises(ConfigError, match="use fewer --steps"):
        PlainLoop(torch.nn.Linear(3, 2), x, y, batch_size=4, steps=11)


def test_bench_single_and_datapath_run_through_fit(tmp_path, capsys):
    assert main(["bench", "single", "--model", "mlp", "--dataset", "synthetic-mnist", "--steps", "3", "--rounds", "2",
                 "--out", str(tmp_path / "single")]) == 0
    metrics = json.loads((tmp_path / "single" / "summary.json").read_text())["metrics"]
    assert metrics["labkit"]["rounds"] == 2 and metrics["ratio"] == metrics["labkit"]["ratio"] > 0
    assert main(["bench", "datapath", "--model", "mlp", "--batch-size", "16", "--steps", "2", "--rounds", "1",
                 "--out", str(tmp_path / "dp")]) == 0
    out = capsys.readouterr().out
    assert "tensor loader" in out and "torch loader" in out and "model only" in out


def _labkit_on_a_forked_rank(monkeypatch):
    """The suite's ``python -m labkit ARGS`` on one forked rank (:func:`run_cli_ranks`): the same CLI entry point,
    exit code and output, without a fresh interpreter importing torch (what the suite runs is the point here)."""
    def run(cmd, capture_output, text, check, env):
        assert cmd[:3] == [sys.executable, "-m", "labkit"] and capture_output and text and not check
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        [(code, out, err)] = run_cli_ranks(cmd[3:], 1, timeout=300)
        return subprocess.CompletedProcess(cmd, code, out, err)
    monkeypatch.setattr("labkit.bench.suite.subprocess", types.SimpleNamespace(run=run))


def test_suite_records_a_strategy_and_rejects_unknown_parts(tmp_path, capsys, monkeypatch):
    _labkit_on_a_forked_rank(monkeypatch)
    assert main(["bench", "suite", "--quick", "--only", "single", "--device", "cpu", "--out", str(tmp_path)]) == 0
    suite = load_suite(tmp_path)
    single = suite["strategies"]["single"]
    assert suite["machine"]["torch"] == torch.__version__ and suite["tag"].startswith("cpu-")
    assert single["samples_per_sec"] > 0 and single["epochs"][0]["test_acc"] > 0.1 and single["memory_lines"]
    assert single["mfu"] == single["hfu"] > 0 and "matmul measured at" in single["peak"]
    assert main(["bench", "suite", "--only", "warp-drive", "--out", str(tmp_path)]) == 2
    assert "unknown suite part(s) warp-drive" in capsys.readouterr().err


def test_report_renders_from_the_committed_references(tmp_path):
    folders = sorted(p for p in REFERENCE.iterdir() if (p / "suite.json").exists())
    assert folders, f"no committed reference results under {REFERENCE}"
    notes = []  # what `labkit bench report results/reference/*` (its README's command) is given
    suites = load_suites(sorted(REFERENCE.iterdir()), printer=notes.append)
    assert notes == [f"note: skipped {REFERENCE / 'README.md'}: not a suite result"]
    for folder, suite in zip(folders, suites):
        assert suite["tag"] == folder.name and suite["machine"]["torch"]
        assert all("error" not in run for run in suite["strategies"].values())
    # a suite recorded before runs reported MFU has no MFU cell; one that did names its peak beside it
    suites[0]["strategies"]["single"].update(mfu=0.0341, hfu=0.0455, peak="2.1 TFLOP/s bf16 (test)")
    page = render(suites, tmp_path).read_text()
    assert page.count("MFU ") == 1 and "MFU 3.41%, HFU 4.55% of 2.1 TFLOP/s bf16 (test)" in page
    for suite in suites:
        assert suite["tag"] in page and "labkit DDP / plain DDP" in page
    for name in PLOTS:
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="not a readable suite result"):
        load_suite(tmp_path / "missing")
    with pytest.raises(ConfigError, match="none of .*README.md is a suite result"):
        load_suites([REFERENCE / "README.md"], printer=notes.append)


def test_a_run_is_plotted_beside_every_reference():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.bench.report import plot_beside_reference, reference_suites

    references = reference_suites()
    run = {"config": {"model": "lenet"}, "metrics": {"samples_per_sec": 123.0}}
    ax = plot_beside_reference(run, "ddp", references=references)
    bars = [p.get_width() for p in ax.patches]
    assert bars == [123.0] + [s["strategies"]["ddp"]["samples_per_sec"] for s in references]
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "your run (lenet)"
    other = {"config": {"model": "resnet8", "dataset": "synthetic-cifar10"}, "metrics": {"samples_per_sec": 9.0}}
    said = []
    assert plot_beside_reference(other, "ddp", references=references, printer=said.append) is None  # nothing drawn
    assert said == ["ddp: no reference run of resnet8 on synthetic-cifar10 yet, so no chart (the references train "
                    "lenet on mnist-sample); your run: 9.0 samples/s"]


@pytest.mark.parametrize("argv, message", [
    (["single", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["single", "--dataset", "nosuch"], "unknown dataset 'nosuch'"),
    (["ddp", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["kfac", "--models", "lenet", "nosuch"], "unknown model 'nosuch'"),
])
def test_unknown_model_or_dataset_is_refused_before_the_results_folder(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"labkit: error: {message}"), err
    assert list(tmp_path.iterdir()) == []  # no runs/bench-NAME/ left behind

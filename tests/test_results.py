"""labkit.results: one schema, written and read back."""
import json
import subprocess
import sys

import matplotlib
import pytest
import torch

from labkit.dist.group import DistEnv
from labkit.results import SCHEMA, RunWriter, environment, host_environment, load_run, plot_metric

matplotlib.use("Agg")


def test_round_trip(tmp_path):
    w = RunWriter(tmp_path / "run")
    for e in range(3):
        w.log({"kind": "epoch", "epoch": e + 1, "test_acc": 0.5 + e / 10})
    w.log({"kind": "bench", "samples_per_sec": 10.0})
    summary = w.finish("demo", "train", {"lr": 0.1}, {"final_test_acc": 0.7})
    run = load_run(tmp_path / "run")
    assert run.summary == summary and summary["schema"] == SCHEMA
    assert {"torch", "hostname", "python"} <= set(summary["environment"])
    assert run.series("test_acc") == ([1, 2, 3], [0.5, 0.6, 0.7])
    assert len(run.records_of("bench")) == 1
    ax = plot_metric([run, run], y="test_acc", labels=["a", "b"])
    assert len(ax.lines) == 2 and list(ax.lines[0].get_xdata()) == [1, 2, 3]


def test_a_summary_of_runs_is_written_without_torch(tmp_path):
    """What the job scripts' summary steps do: read runs, write a summary with their host's environment; a
    fresh interpreter (the step's) that never imports torch, and the same environment torch would give."""
    RunWriter(tmp_path / "a").finish("a", "train", {}, {"acc": 0.5}, DistEnv(device=torch.device("cpu")))
    assert load_run(tmp_path / "a").summary["environment"]["world_size"] == 1
    assert host_environment(load_run(tmp_path / "a")) == json.loads(json.dumps(environment()))
    step = ("import sys\nfrom labkit.results import RunWriter, host_environment, load_run\n"
            f"run = load_run({str(tmp_path / 'a')!r})\n"
            f"RunWriter({str(tmp_path)!r}).finish('both', 'comparison', {{}}, {{'acc': 0.5}}, host=host_environment(run))\n"
            "print('torch' in sys.modules)")
    printed = subprocess.run([sys.executable, "-c", step], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "False"
    assert load_run(tmp_path).summary["environment"] == json.loads(json.dumps(environment()))


def test_disabled_writer_writes_nothing(tmp_path):
    w = RunWriter(tmp_path / "r", enabled=False)
    w.log({"kind": "epoch"})
    w.finish("x", "train", {}, {})
    assert not (tmp_path / "r").exists()


def test_bad_records_and_files(tmp_path):
    with pytest.raises(ValueError, match="needs a 'kind'"):
        RunWriter(tmp_path).log({"epoch": 1})
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        load_run(tmp_path / "missing")
    (tmp_path / "summary.json").write_text(json.dumps({"schema": "other/1"}))
    with pytest.raises(ValueError, match="expected 'labkit.run/1'"):
        load_run(tmp_path)

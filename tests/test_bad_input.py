"""Bad input found by testing the real commands: each case is one ``labkit: error:`` line and exit code 2,
and files the kit writes are what the user asked for."""
import json
import os
import stat

import pytest

from labkit.cli import main
from labkit.dist import DistEnv
from labkit.errors import ConfigError
from labkit.strategies.pipelining import PipelineStrategy
from labkit.results import RunWriter, atomic_write_text

QUICK = ["--dataset", "synthetic-mnist", "--model", "mlp", "--train-size", "64", "--test-size", "32",
         "--batch-size", "16", "--max-steps", "2", "--device", "cpu", "--log-every", "100"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error: "), err
    return err[0]


@pytest.mark.parametrize("out", ["/proc/labkit/run", "/dev/null/run"])
def test_unwritable_out_is_one_line_and_exit_2(capsys, out):
    assert main(["train", *QUICK, "--out", out]) == 2
    line = _one_error_line(capsys)
    assert f"cannot write {out}" in line and "--out" in line


def test_unwritable_run_writer_and_atomic_write(tmp_path):
    from labkit.errors import OutputError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="cannot write"):
        RunWriter(blocker / "run")
    with pytest.raises(OutputError, match="cannot write"):
        atomic_write_text(blocker / "summary.json", "{}")


def test_zero_microbatches_is_rejected(capsys, tmp_path):
    assert main(["train", *QUICK, "--strategy", "gpipe", "--num-microbatches", "0", "--out", str(tmp_path)]) == 2
    assert "--num-microbatches must be >= 1, got 0" in _one_error_line(capsys)
    two_stages = DistEnv(world_size=2, local_world_size=2)  # the check comes before any communication
    with pytest.raises(ConfigError, match="--num-microbatches must be >= 1, got 0"):
        PipelineStrategy(two_stages, {"num_microbatches": 0})
    assert PipelineStrategy(two_stages, {"num_microbatches": None}).options["num_microbatches"] == 4


def test_recorded_microbatches_are_the_ones_that_ran(tmp_path):
    assert main(["train", *QUICK, "--strategy", "gpipe", "--out", str(tmp_path)]) == 0
    options = json.loads((tmp_path / "summary.json").read_text())["config"]["strategy_options"]
    assert options["num_microbatches"] == 4 and options["checkpoint_mode"] == "except_last"


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_written_files_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        writer = RunWriter(tmp_path)
        writer.log({"kind": "epoch", "epoch": 1})
        writer.finish("r", "train", {}, {})
        atomic_write_text(tmp_path / "trace.json", "{}")
    finally:
        os.umask(old)
    for name in ("metrics.jsonl", "summary.json", "trace.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name

"""The labkit command: sub-commands, and bad input -> one clear line, exit code 2."""
import subprocess
import sys

import pytest
import torch

from labkit.cli import main


def test_help_lists_subcommands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("tour", "train", "data", "allreduce", "bench", "check"):
        assert command in out


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "nope", "--dataset", "synthetic-mnist"], "unknown model 'nope'"),
    (["train", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["train", "--batch-size", "0"], "--batch-size must be > 0"),
    (["check", "nothing"], "unknown check 'nothing'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    assert main(argv + (["--out", str(tmp_path)] if argv[0] == "train" else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error: ") and message in err[0]


def test_missing_dataset_offline_names_the_fetch_command(capsys, tmp_path):
    assert main(["train", "--dataset", "cifar10", "--data-root", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "labkit data fetch cifar10" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_flag_on_cpu_node_exits_2_from_the_real_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "labkit", "train", "--device", "cuda", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "no usable GPU" in proc.stderr and "--device cpu" in proc.stderr

"""At the edges: every rank words a checkpoint error alike (so a torchrun job prints it once), a checkpoint of
another model is refused by name, files reach the disk before they replace the old ones, a closed pipe ends a
command quietly, and a multi-rank strategy in one process says how to start ranks."""
import os
import stat
import subprocess
import sys

import pytest
import torch

from labkit import results
from labkit.cli import main
from labkit.dist.testing import run_ranks
from labkit.errors import CheckpointError
from labkit.strategies.base import Strategy
from labkit.train.checkpoint import checkpoint_on_every_rank, load_training_state

QUICK = ["--dataset", "synthetic-mnist", "--train-size", "64", "--test-size", "32", "--batch-size", "16",
         "--max-steps", "1", "--device", "cpu", "--log-every", "100"]


class _Sharded(Strategy):
    replicated = False  # one checkpoint file per rank, as tensor-parallel, pipeline, ZeRO and FSDP write


def _checkpoint_errors(env, folder):
    """Rank 2 has no file, then rank 1's file is garbage: the message each rank raises, for both."""
    strategy = _Sharded(env)
    path = strategy.checkpoint_file(folder)
    if env.rank < 2:
        torch.save({"model": {}, "epoch": 1}, path)
    messages = []
    try:
        checkpoint_on_every_rank(path, strategy)
    except CheckpointError as exc:
        messages.append(str(exc))
    torch.save({"model": {}, "epoch": 1}, path)
    if env.rank == 1:
        path.write_bytes(b"not a checkpoint")
    try:
        load_training_state(path, strategy, torch.nn.Linear(1, 1), None, None, None)
    except CheckpointError as exc:
        messages.append(str(exc))
    return messages


def test_checkpoint_errors_read_the_same_on_every_rank(tmp_path):
    """A 3-rank job resuming a 2-rank run's files, and a corrupt shard on one rank: every rank raises the same
    words (errors.report prints a message once per job), naming the ranks concerned, not its own file."""
    missing, corrupt = zip(*run_ranks(_checkpoint_errors, 3, tmp_path))
    assert len(set(missing)) == 1 and len(set(corrupt)) == 1, (missing, corrupt)
    assert missing[0].startswith(f"rank 2 of this 3-rank job finds no checkpoint file in {tmp_path} (2 do)")
    assert "resume with the rank count that wrote it" in missing[0]
    assert corrupt[0].startswith(f"the checkpoint file of rank 1 in {tmp_path} is corrupt")


def test_resuming_another_models_checkpoint_names_both_models(tmp_path, capsys, one_thread):
    out = ["--out", str(tmp_path)]
    assert main(["train", "--model", "mlp", *QUICK, *out]) == 0
    capsys.readouterr()
    assert main(["train", "--model", "lenet", *QUICK, *out, "--resume"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"labkit: error: the checkpoint in {tmp_path} holds model mlp, this run builds lenet: use --model "
                   "mlp to continue it, or another --out, or run without --resume"], err


def test_resuming_a_gpt_at_another_dropout_rate_is_refused(tmp_path, capsys, one_thread):
    gpt = ["--model", "gpt-tiny", "--dataset", "text-sample", "--train-size", "32", "--test-size", "16",
           "--batch-size", "8", "--max-steps", "1", "--device", "cpu", "--log-every", "100", "--out", str(tmp_path)]
    assert main(["train", *gpt, "--dropout", "0.1"]) == 0
    capsys.readouterr()
    assert main(["train", *gpt, "--resume"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"labkit: error: the checkpoint in {tmp_path} holds dropout 0.1, this run builds 0.0: use "
                   "--dropout 0.1 to continue it, or another --out, or run without --resume"], err


def test_a_multi_rank_strategy_in_one_process_says_how_to_start_ranks(tmp_path, capsys, one_thread):
    assert main(["train", "--model", "mlp", "--strategy", "ddp", *QUICK, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "note: one process, so --strategy ddp runs on 1 rank; for N ranks start it with torchrun " \
           "--nproc_per_node N -m labkit train --strategy ddp" in out


def test_atomic_write_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        fsync(fd)

    def recording_replace(src, dst):
        events.append("rename")
        replace(src, dst)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    results.atomic_write_text(tmp_path / "summary.json", "{}")
    assert events == ["fsync file", "rename", "fsync folder"]
    assert (tmp_path / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("argv", [["faults", "list"]])
def test_a_closed_pipe_ends_a_listing_quietly(argv):
    """``labkit faults list | head -3``: the reader leaves before the list is printed. The console script's own
    process, with a listing that does not import torch."""
    proc = subprocess.Popen([sys.executable, "-m", "labkit", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command has started to print
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + 13 and err == "", err

"""The seed-003 GPipe hands-on (jobs/gpipe/): the checker passes the answer and a completed exercise, fails
the untouched or half-done exercise naming the missing step; the scripts print the seed's lines."""
import functools
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torchgpipe.balance

from labkit.exercises.cli import run_check


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    """Quick mode: the scripts' defaults shrink (4 micro-batches of 4 digits); one thread for tiny batches.
    torchgpipe's balance_by_time repeats its layer-by-layer profile for a second of wall clock: here it makes one
    pass (any balance over two devices computes the same function, which is what the checker compares)."""
    monkeypatch.setenv("LABKIT_QUICK", "1")
    monkeypatch.setattr(torchgpipe.balance, "balance_by_time",
                        functools.partial(torchgpipe.balance.balance_by_time, timeout=1e-6))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

HANDS_ON = Path(__file__).resolve().parents[1] / "jobs" / "gpipe"
EXERCISE = HANDS_ON / "mnist_gpipe_exercise.py"
# What a learner changes, step by step (the exercise text must contain every left-hand side).
STEPS = {
    1: ('model = get_model("resnet50", in_channels=1, image_size=28)\n',
        'model = get_model("resnet50", in_channels=1, image_size=28, sequential=True)\n'),
    2: ("    model = model.to(devices[0])\n", ""),
    34: ("    return model\n\n\ndef place_batch",
         ("    balance = [len(model) // 2, len(model) - len(model) // 2]\n"
          "    model = GPipe(model, balance, devices=devices, chunks=chunks)\n    return model\n\n\ndef place_batch")),
    5: ("return x.to(devices[0]), y.to(devices[0])", "return x.to(devices[0]), y.to(devices[-1])"),
}


def exercise_with(tmp_path: Path, steps) -> Path:
    text = EXERCISE.read_text()
    for step in steps:
        old, new = STEPS[step]
        assert text.count(old) == 1, f"the exercise no longer contains step {step}'s line {old!r}"
        text = text.replace(old, new)
    path = tmp_path / "mnist_gpipe_exercise.py"
    path.write_text(text)
    return path


def test_untouched_exercise_fails_at_step_1_and_lists_every_step(capsys):
    assert run_check("gpipe-exercise", [str(EXERCISE)]) == 1
    out = capsys.readouterr().out
    assert "(1) the model is an nn.Sequential" in out and "MISSING: build_model returns a ResNet" in out
    assert "(2) no model.to(device)" in out and "MISSING: build_model still moves the model (line" in out
    assert "MISSING: input on cpu, target on cpu" in out
    assert "Not done yet: step (1) is missing -- build it flat: get_model(..., sequential=True). " \
           "Still to do: (1), (2), (3), (4), (5)." in out


def test_exercise_that_still_moves_the_model_fails_at_step_2(tmp_path, capsys):
    assert run_check("gpipe-exercise", [str(exercise_with(tmp_path, [1, 34, 5]))]) == 1
    out = capsys.readouterr().out
    line = EXERCISE.read_text().splitlines().index(STEPS[2][0].rstrip("\n")) + 1
    assert f"MISSING: build_model still moves the model (line {line}: .to(...))" in out
    assert "Not done yet: step (2) is missing -- delete model.to(...) in build_model. Still to do: (2)." in out


def test_completed_exercise_passes(tmp_path, capsys):
    assert run_check("gpipe-exercise", [str(exercise_with(tmp_path, [1, 2, 34, 5]))]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok\n") == 6 and "All five steps done" in out


def test_answer_passes(capsys):
    assert run_check("gpipe-exercise", [str(HANDS_ON / "mnist_gpipe_answer.py")]) == 0
    assert "All five steps done" in capsys.readouterr().out


def test_a_missing_file_is_a_clear_error():
    with pytest.raises(Exception, match="no exercise file nowhere.py; pass its path"):
        run_check("gpipe-exercise", ["nowhere.py"])


SEED_ESTIMATED = re.compile(r"^train \| epoch 1/1 \(\d+%\) \| [\d.]+ samples/sec \(estimated\)$", re.MULTILINE)
SEED_FINAL = re.compile(r"^train \| epoch 1/1 \(\d+%\) \| [\d.]+ samples/sec$", re.MULTILINE)


def test_answer_script_prints_the_seed_lines_and_writes_results(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("mnist_gpipe_answer", HANDS_ON / "mnist_gpipe_answer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--batchsize", "2", "--num_microbatches", "2", "--max_steps", "2", "--balance_by", "memory",
                 "--dataset", "mnist-sample", "--devices", "cpu", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert SEED_ESTIMATED.search(out) and SEED_FINAL.search(out)
    assert re.search(r"^CPU \(process, all devices\): resident \d+\.\d{3} GB, peak \d+\.\d{3} GB$", out, re.MULTILINE)
    assert (tmp_path / "summary.json").exists()

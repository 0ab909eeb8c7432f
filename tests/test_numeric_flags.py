"""Every number any command takes is finite and in range: a bad one is one ``labkit: error:`` line and exit
code 2 as the flags are read, before anything starts. The table names every numeric flag of every command
(each strategy's, optimizer's and benchmark's included) with values outside its range; a new numeric flag
fails :func:`test_the_table_names_every_numeric_flag` until it is added here. The cases parse in-process."""
import argparse
import functools
import math
import subprocess
import sys

import pytest

from labkit.bench import BENCHMARKS
from labkit.cli import COMMANDS, build_parser, main
from labkit.optim import OPTIMIZERS
from labkit.ranges import Range, check, within
from labkit.strategies import STRATEGIES
from labkit.train.config import TrainConfig

#: command line before the flag -> {flag: values outside its range}
BAD = {
    "tour": {"--epochs": ["0"]},
    "train": {"--train-size": ["0"], "--test-size": ["0"], "--num-workers": ["-1"], "--epochs": ["0"],
              "--batch-size": ["0"], "--test-batch-size": ["0"], "--base-lr": ["0", "-0.1"], "--momentum": ["1", "-1"],
              "--weight-decay": ["-1"], "--lr-decay": ["0", "-3"], "--lr-decay-factor": ["0", "1.5"],
              "--warmup-epochs": ["-1"], "--max-steps": ["0"], "--steps": ["0"], "--seed": ["-1", "4294967296"], "--timeout-s": ["0"],
              "--log-every": ["0"], "--step-delay-s": ["-1"], "--seq-len": ["0"], "--dropout": ["-0.1", "1"], "--watchdog": ["-1"]},
    "sample": {"--tokens": ["0"], "--temperature": ["0"], "--top-k": ["0"], "--seed": ["-1"]},
    "allreduce verify": {"--timeout": ["0", "-5"]},
    "faults run": {"--ranks": ["0", "9"], "--watchdog": ["0", "-1"]},
    "doctor": {"--watchdog": ["-1", "1e8"]},
    "allreduce animate": {"--ranks": ["1"], "--interval": ["0"]},
    "allreduce bench": {"--timeout": ["0"], "--repeats": ["0"]},
    "advise": {"--ranks": ["0"], "--batch-size": ["0"], "--memory-limit": ["0"], "--base-lr": ["0"], "--repeats": ["2"], "--seq-len": ["1"],
               "--steps": ["3"]},
    "train --strategy ddp": {"--bucket-mb": ["0"], "--global-batch-size": ["0"], "--sync-every": ["0"],
                             "--outer-lr": ["0", "11"], "--outer-momentum": ["-0.1", "1"]},
    "train --strategy model-parallel": {"--mp-devices": ["0"], "--mp-split-points": ["0"], "--mp-split-size": ["0"]},
    "train --strategy gpipe": {"--num-microbatches": ["0"], "--partitions": ["0"], "--balance": ["0"]},
    "train --strategy pipeline": {"--num-microbatches": ["0"], "--balance": ["0"], "--trace-steps": ["-1"],
                                  "--pp-virtual": ["0"]},
    "train --strategy mesh": {"--num-microbatches": ["0"], "--balance": ["0"], "--trace-steps": ["-1"],
                              "--pp-virtual": ["0"], "--bucket-mb": ["0"], "--sync-every": ["0"],
                              "--outer-lr": ["0", "11"], "--outer-momentum": ["-0.1", "1"]},
    "train --strategy zero": {"--zero-stage": ["0", "4"], "--bucket-mb": ["0"]},
    "train --strategy ps": {"--ps-servers": ["0"], "--max-staleness": ["-1"], "--ps-momentum": ["-1", "1"],
                            "--ps-timeout-s": ["0"]},
    "train --strategy ft": {"--ft-replicas": ["0", "65"], "--ft-timeout-s": ["0"], "--ft-restart-delay-s": ["-1"],
                            "--ft-restarts": ["-1"], "--ft-replica": ["-1"],  # and its replicas' mesh flags:
                            "--num-microbatches": ["0"], "--balance": ["0"], "--trace-steps": ["-1"],
                            "--pp-virtual": ["0"], "--bucket-mb": ["0"], "--sync-every": ["0"],
                            "--outer-lr": ["0", "11"], "--outer-momentum": ["-0.1", "1"]},
    "train --optimizer lars": {"--lars-trust-coefficient": ["0"]},
    "train --optimizer lamb": {"--lamb-betas": ["-1", "1"], "--lamb-eps": ["0"]},
    "train --optimizer kfac": {"--kfac-update-freq": ["-1"], "--kfac-inv-update-freq": ["0"], "--kfac-damping": ["0"],
                               "--kfac-factor-decay": ["-1", "1"], "--kfac-kl-clip": ["-1"],
                               "--kfac-grad-worker-fraction": ["0", "1.5"], "--lars-trust-coefficient": ["0"],
                               "--lamb-betas": ["-1"], "--lamb-eps": ["0"]},
    "train --optimizer shampoo": {"--shampoo-update-freq": ["0"], "--shampoo-decay": ["0", "1.5"],
                                  "--shampoo-eps": ["0"], "--shampoo-max-dim": ["0"],
                                  "--shampoo-worker-fraction": ["0", "1.5"]},
    "train --optimizer soap": {"--soap-update-freq": ["0"], "--soap-betas": ["-1", "1"], "--soap-shampoo-beta": ["1"],
                               "--soap-eps": ["0"], "--soap-max-dim": ["0"], "--soap-worker-fraction": ["0", "1.5"]},
    "train --optimizer muon": {"--muon-ns-steps": ["0", "100"], "--muon-worker-fraction": ["0", "1.5"]},
    "bench single": {"--batch-size": ["0"], "--steps": ["0"], "--rounds": ["0"], "--threads": ["0"]},
    "bench ddp": {"--compare-ranks": ["-1"], "--batch-size": ["0"], "--steps": ["0"], "--rounds": ["0"],
                  "--repeat": ["0"], "--threads": ["0"], "--compare-epochs": ["0"]},
    "bench model-parallel": {"--batch-size": ["0"], "--split-sizes": ["0"], "--mp-devices": ["0"], "--steps": ["0"],
                             "--rounds": ["0"], "--ranks": ["0"], "--rank-batch-size": ["0"]},
    "bench gpipe": {"--batch-size": ["0"], "--chunks": ["0"], "--partitions": ["0"], "--balance": ["0"],
                    "--steps": ["0"], "--rounds": ["0"], "--threads": ["0"]},
    "bench gpt": {"--seq-len": ["0"], "--batch-size": ["0"], "--steps": ["0"], "--rounds": ["0"], "--threads": ["0"]},
    "bench kfac": {"--batch-size": ["0"], "--freqs": ["0"], "--steps": ["0"], "--rounds": ["0"], "--threads": ["0"]},
    "bench zero": {"--batch-size": ["0"], "--steps": ["0"], "--rounds": ["0"], "--bucket-mb": ["0"], "--seq-len": ["0"]},
    "bench datapath": {"--batch-size": ["0"], "--steps": ["0"], "--rounds": ["0"], "--threads": ["0"]},
    "bench largebatch": {"--scales": ["0"], "--batch-size": ["0"], "--epochs": ["0"], "--train-size": ["0"],
                         "--test-size": ["0"], "--seed": ["-1"]},
    "bench ps": {"--workers": ["0"], "--epochs": ["0"], "--batch-size": ["0"], "--base-lr": ["0"], "--train-size": ["0"],
                 "--test-size": ["0"], "--max-staleness": ["-1"], "--slow-factor": ["0.5"], "--target-acc": ["0", "1.5"],
                 "--rounds": ["0"]},
    "bench pp-schedules": {"--ranks": ["1", "17"], "--microbatches": ["0"], "--steps": ["1"], "--rounds": ["0"]},
    "bench tp": {"--ranks": ["1", "65"], "--vocab-size": ["1"], "--block-size": ["1"], "--batch-size": ["0"],
                 "--steps": ["0"], "--rounds": ["0"], "--threads": ["0"]},
}

#: ``labkit check NAME`` hands its arguments to the checker, which builds its parser as it runs: listed by hand
CHECKERS = {"check average-gradients mine.py": {"--ranks": ["1", "65"]},
            "check column-parallel mine.py": {"--world-sizes": ["0", "65"]}}


def _command_lines() -> list[list[str]]:
    """Every command line that brings flags of its own: each command, strategy, optimizer and benchmark."""
    return ([[c] for c in COMMANDS] + [["train", "--strategy", s] for s in STRATEGIES]
            + [["train", "--optimizer", o] for o in OPTIMIZERS] + [["bench", b] for b in BENCHMARKS])


def _numeric_actions(words: list[str]) -> dict[str, argparse.Action]:
    """``{"allreduce verify --timeout": action, ...}``: the int and float flags ``words`` bring."""
    parser = build_parser(words)
    if words[0] == "train":  # the strategy's and optimizer's flags join when the command line is read
        train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
        train._add_owned(words[2] if words[1:2] == ["--strategy"] else "single",
                         words[2] if words[1:2] == ["--optimizer"] else "sgd")
    found = {}

    def walk(p, path):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, path + [name])
            elif action.type not in (None, str):
                found[" ".join(path + [action.option_strings[0]])] = action
    walk(parser, [])
    return found


@functools.lru_cache(maxsize=1)
def _all_numeric_flags() -> dict[str, argparse.Action]:
    base = {key for words in ([c] for c in COMMANDS) for key in _numeric_actions(words)}
    flags = {}
    for words in _command_lines():
        for key, action in _numeric_actions(words).items():
            if key in base and len(words) > 1:
                continue
            if words[0] == "train" and len(words) > 1:  # a flag the strategy or optimizer brings
                key = " ".join(words) + key[len("train"):]
            flags[key] = action
    return flags


def _cases(table=BAD):
    for command, flags in table.items():
        for flag, values in flags.items():
            for value in values:
                yield command, flag, value


PAIRS = ("--lamb-betas", "--soap-betas")  # nargs=2


def test_the_table_names_every_numeric_flag():
    flags = _all_numeric_flags()
    assert set(flags) == {f"{command} {flag}" for command, flag, _ in _cases()}
    assert len(flags) == 179  # train 21, its strategies and optimizers 67, benchmarks 71, the others 20
    for key, action in flags.items():  # each is checked as it is read, and its default is allowed
        assert hasattr(action.type, "range"), f"{key}: type=within(kind, interval) or a FLAGS 'range'"
        defaults = action.default if isinstance(action.default, (list, tuple)) else [action.default]
        assert all(d is None or d in action.type.range for d in defaults), (key, action.default)


@pytest.mark.parametrize("command,flag,value", [*_cases(), *_cases(CHECKERS)])
def test_out_of_range_is_one_line_and_exit_2(capsys, command, flag, value):
    words = command.split()
    pair = ["0.5"] if flag in PAIRS else []  # nargs=2
    with pytest.raises(SystemExit) as stop:
        main([*words, flag, *pair, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"labkit: error: {flag} must be ") and f"got {value}" in err[0], err


@pytest.mark.parametrize("command,flag", sorted({(c, f) for c, f, _ in _cases()}))
def test_nan_inf_and_words_are_refused(capsys, command, flag):
    action = _all_numeric_flags()[f"{command} {flag}"]
    words = command.split()
    values = ["nan", "inf", "-inf", "x"] if action.type.kind == "float" else ["1.5", "x"]
    for value in values:
        if flag in PAIRS and value == "-inf":
            continue  # nargs=2 takes no --flag=VALUE, and -inf alone reads as an option
        with pytest.raises(SystemExit) as stop:
            main([*words, *([flag, "0.5", value] if flag in PAIRS else [f"{flag}={value}"])])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        what = "a finite number" if value in ("nan", "inf", "-inf") else (
            "a number" if action.type.kind == "float" else "a whole number")
        assert err == [f"labkit: error: {flag} must be {what}, got {value!r}"
                       + ("" if words[0] == "train" else f" (see labkit {' '.join(words)} --help)")], err


def test_the_issue_cases_read_as_one_sentence(capsys):
    for argv, line in [
        (["train", "--timeout-s", "0"], "--timeout-s must be > 0 and <= 10000000, got 0"),
        (["train", "--seed", "-1"], "--seed must be >= 0 and <= 4294967295, got -1"),
        (["train", "--lr-decay", "-3"], "--lr-decay must be >= 1, got -3"),
        (["train", "--lr-decay", "5", "2"], "--lr-decay epochs must be increasing, e.g. --lr-decay 2 5; got 5 2"),
        (["allreduce", "verify", "--timeout", "0"],
         "--timeout must be > 0 and <= 10000000, got 0 (see labkit allreduce verify --help)"),
    ]:
        try:
            assert main(argv) == 2
        except SystemExit as stop:
            assert stop.code == 2
        assert capsys.readouterr().err.splitlines() == [f"labkit: error: {line}"], argv


def test_a_config_built_in_python_gets_the_same_checks():
    for key, value, line in [("base_lr", math.nan, "--base-lr must be > 0, got nan"),
                             ("weight_decay", math.inf, "--weight-decay must be >= 0, got inf"),
                             ("lr_decay", [5, 2], "--lr-decay epochs must be increasing"),
                             ("lr_decay", [0], "--lr-decay must be >= 1, got 0"),
                             ("epochs", 1.5, "--epochs must be a whole number, got 1.5")]:
        with pytest.raises(ValueError, match=line.replace("(", r"\(")):
            TrainConfig(**{key: value}).validate()
    TrainConfig(lr_decay=[2, 5], base_lr=0.1).validate()


def test_ranges_read_interval_notation():
    assert [v in Range("(0, 1]") for v in (0, 1e-9, 1, 1.5, math.nan)] == [False, True, True, False, False]
    assert Range("[1, inf)").describe() == ">= 1" and Range("(-inf, 0)").describe() == "< 0"
    assert math.inf in Range("[1, inf]") and within("float", "[1, inf]")("inf") == math.inf
    with pytest.raises(ValueError, match="not an interval"):
        within("int", "1..3")
    with pytest.raises(ValueError, match="must be a whole number, got 2.5"):
        check("--n", 2.5, "int", "[1, inf)")


def test_one_line_from_a_real_process():
    """The shape a learner sees, without a parser in the test's own process: one line on stderr, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "labkit", "allreduce", "verify", "--timeout", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.splitlines() == ["labkit: error: --timeout must be > 0 and <= 10000000, got 0 (see labkit "
                                        "allreduce verify --help)"]

"""`labkit train` flags: each strategy and optimizer owns its own, a foreign flag is one clear error naming its
owner, every flag shows help and default, and none of this imports torch."""
import argparse
import importlib
import os
import subprocess
import sys

import pytest
import torch

from labkit.cli import HelpFormatter, main
from labkit.flags import read_flags
from labkit.optim import OPTIMIZERS
from labkit.strategies import STRATEGIES, strategy_flags
from labkit.train.cli import add_parser, flag_owners

#: a flag (and a value) of each strategy, to hand to every other strategy
SAMPLE = {"ddp": ["--allreduce", "ring"], "model-parallel": ["--mp-devices", "3"],
          "gpipe": ["--partitions", "2"], "pipeline": ["--schedule", "1f1b"], "zero": ["--zero-stage", "2"],
          "fsdp": ["--fsdp-no-reshard"]}


def _exit_code(argv: list[str]) -> int:
    """``labkit`` exit status: argparse errors leave by SystemExit, labkit errors by main's return value."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _parser():
    parser = argparse.ArgumentParser(prog="labkit")
    add_parser(parser.add_subparsers(dest="command"))
    return parser


#: SAMPLE's flags that a later strategy owns too (the mesh's pp dimension: the pipeline's --schedule; its dp
#: dimension: ddp's --allreduce; ft, whose replicas may be meshes, has every mesh dimension's flags)
SHARED = {"--schedule": ("mesh", "ft"), "--allreduce": ("mesh", "ft")}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_rejects_the_other_strategies_flags(strategy, capsys, tmp_path):
    mine = {f["flag"] for f in strategy_flags(strategy)}
    for owner, (flag, *value) in SAMPLE.items():
        if flag in mine:
            continue
        assert _exit_code(["train", "--strategy", strategy, flag, *value, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        owners = " and ".join(f"--strategy {name}" for name in (owner, *SHARED.get(flag, ())))
        assert err == [f"labkit: error: {flag} is a flag of {owners}, not of --strategy {strategy}"]
    assert _exit_code(["train", "--strategy", strategy, "--kfac-damping", "0.1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("labkit: error: --kfac-damping is a flag of --optimizer kfac, "
                                               "not of --optimizer sgd")


def test_the_examples_of_silently_accepted_flags_are_now_refused(capsys):
    assert _exit_code(["train", "--strategy", "hybrid", "--allreduce", "ring", "--mp-devices", "3"]) == 2
    assert "--allreduce is a flag of --strategy ddp and --strategy mesh and --strategy ft, not of --strategy hybrid" in \
        capsys.readouterr().err
    assert _exit_code(["train", "--optimizer", "sgd", "--kfac-update-freq", "5"]) == 2
    assert "--kfac-update-freq is a flag of --optimizer kfac, not of --optimizer sgd" in capsys.readouterr().err
    assert _exit_code(["train", "--strategy", "pipeline", "--balance-by", "time"]) == 2  # gpipe's, not shared
    assert "--balance-by is a flag of --strategy gpipe, not of --strategy pipeline" in capsys.readouterr().err
    assert _exit_code(["train", "--strategy", "warp"]) == 2
    assert "unknown strategy 'warp'; choose one of: single, ddp" in capsys.readouterr().err


def test_only_the_chosen_strategys_and_optimizers_flags_are_parsed():
    args = _parser().parse_args(["train", "--strategy", "gpipe", "--balance", "2", "4", "--optimizer", "kfac",
                                 "--kfac-damping", "0.01"])
    assert args.balance == [2, 4] and args.num_microbatches == 4 and args.kfac_damping == 0.01
    assert not hasattr(args, "schedule") and not hasattr(args, "allreduce") and not hasattr(args, "mp_devices")
    shared = flag_owners()
    assert shared["--num-microbatches"] == ["--strategy gpipe", "--strategy pipeline", "--strategy mesh",
                                            "--strategy ft"]
    assert shared["--kfac-update-freq"] == ["--optimizer kfac"]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_flag_has_help_and_every_valued_flag_shows_its_default(strategy):
    optimizer = next(name for name, module in OPTIMIZERS.items() if module)
    parser = _parser()
    parser.parse_args(["train", "--strategy", strategy, "--optimizer", optimizer])
    train = parser._subparsers._group_actions[0].choices["train"]
    formatter = HelpFormatter("labkit train")
    for action in train._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
            shown = formatter._get_help_string(action)
            if action.nargs == 0:  # a switch: "(default: True)" beside --no-checkpoint would read backwards
                assert "%(default)" not in shown, action.option_strings
            else:
                assert "default" in shown, action.option_strings


def test_flags_literals_agree_with_the_modules_that_own_them():
    from labkit.parallel import ddp, dp, pipeline_stages, pp
    from labkit.strategies import balance as gpipe_balance
    from labkit.strategies import gpipe
    from labkit.strategies.ps import server as ps_server
    from labkit.strategies.ps import strategy as ps

    for target in STRATEGIES.values():
        module = importlib.import_module(target.partition(":")[0])
        assert read_flags(module.__name__) == tuple(getattr(module, "FLAGS", ()))
    choices = {f["flag"]: f.get("choices") for m in (ddp, gpipe, pp) for f in m.FLAGS}
    assert tuple(choices["--allreduce"]) == dp.ALLREDUCE_MODES
    assert tuple(choices["--balance-by"]) == gpipe_balance.BALANCE_METHODS
    assert tuple(choices["--checkpoint-mode"]) == gpipe.CHECKPOINT_MODES
    assert tuple(choices["--schedule"]) == tuple(pipeline_stages.SCHEDULES)
    assert tuple(next(f["choices"] for f in ps.FLAGS if f["flag"] == "--ps-mode")) == ps_server.MODES


def test_help_and_flag_errors_do_not_import_torch():
    code = """
import argparse, contextlib, io, sys
from labkit.train import cli as train_cli
def parse(argv):
    p = argparse.ArgumentParser(prog="labkit"); train_cli.add_parser(p.add_subparsers(dest="command"))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            p.parse_args(argv)
        except SystemExit as exit:
            return exit.code, err.getvalue()
for argv in (["train", "--help"], ["train", "--strategy", "ddp", "--optimizer", "kfac", "--help"]):
    assert parse(argv)[0] == 0, argv
code, err = parse(["train", "--strategy", "hybrid", "--mp-devices", "3"])
assert code == 2 and "--mp-devices is a flag of --strategy model-parallel" in err, err
assert "torch" not in sys.modules, "torch was imported"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_deterministic_reaches_the_config_and_selects_repeatable_kernels(monkeypatch):
    from labkit.dist import group as kdist
    from labkit.train.cli import config_from_argv

    assert config_from_argv(["--deterministic"]).deterministic and not config_from_argv([]).deterministic
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, warn_only=False: calls.append((mode,
                                                                                                         warn_only)))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    kdist.deterministic_kernels()
    assert calls == [(True, True)] and torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_steps_is_the_whole_runs_length_and_max_steps_each_epochs(tmp_path, capsys):
    """``--steps 7`` over 5 steps per epoch: 2 epochs, the second cut after 2 steps, said in the header; with
    ``--max-steps 2`` an epoch has 2 steps, so the same 7 steps take 4 epochs; ``--epochs`` beside it is refused."""
    import json

    base = ["train", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "160", "--test-size", "32",
            "--batch-size", "32", "--log-every", "100", "--no-checkpoint"]
    assert main([*base, "--steps", "7", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "| 5 steps/epoch, 2 epoch(s), 7 steps in all" in out.splitlines()[0], out
    finals = [ln for ln in out.splitlines() if ln.startswith("train | epoch") and not ln.endswith("(estimated)")]
    assert len(finals) == 2 and finals[0].startswith("train | epoch 1/2 (100%)")
    assert finals[1].startswith("train | epoch 2/2 (100%)")
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["metrics"]["epochs_run"] == 2 and summary["config"]["epochs"] == 2
    assert main([*base, "--steps", "7", "--max-steps", "2", "--out", str(tmp_path / "b")]) == 0
    assert "| 2 steps/epoch, 4 epoch(s), 7 steps in all" in capsys.readouterr().out
    assert main([*base, "--max-steps", "2", "--epochs", "3", "--out", str(tmp_path / "c")]) == 0
    assert "| 2 steps/epoch, 3 epoch(s), 6 steps in all" in capsys.readouterr().out
    assert _exit_code([*base, "--steps", "7", "--epochs", "2", "--out", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip() == ("labkit: error: --steps 7 is the whole run's length and --epochs 2 "
                                               "another: give one of them")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("argv, flag, dim", [
    (["--mesh", "dp=2", "--sequence-parallel"], "--sequence-parallel", "tp"),
    (["--mesh", "tp=2", "--num-microbatches", "8"], "--num-microbatches", "pp"),
    (["--mesh", "tp=2,pp=2", "--dp-shard", "zero2"], "--dp-shard", "dp"),
    (["--mesh", "dp=2", "--cp-layout", "contiguous"], "--cp-layout", "cp"),
])
def test_a_flag_of_a_dimension_the_mesh_lacks_is_refused_before_any_rank_starts(argv, flag, dim, capsys, tmp_path):
    """Each would otherwise train as if it were not there; refused as the flags are read (one process, no ranks)."""
    assert _exit_code(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"labkit: error: {flag} is a flag of the {dim} dimension, which --mesh {argv[1]} does not have; "
                   f"add {dim}=N (N >= 2) to --mesh, or leave {flag} out")
    assert not (tmp_path / "run").exists()


def test_a_second_run_on_a_folder_in_use_is_refused_in_one_line(tmp_path, capsys):
    """Another process holds the run folder's lock (as a running ``labkit train`` does): this run stops before any
    work, naming the holder; once it is gone, the folder is free again."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom labkit.results import run_dir_lock\n"
         f"with run_dir_lock({str(out)!r}) as busy:\n    print(busy, flush=True)\n    sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "None"  # the holder has it
        argv = ["train", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "64", "--test-size", "32",
                "--max-steps", "1", "--no-checkpoint", "--out", str(out)]
        assert _exit_code(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"labkit: error: {out} is in use by another run (pid {holder.pid} on {os.uname().nodename}); "
                       "wait for it to end, or give this run another --out"), err
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.communicate("")
    assert _exit_code(argv) == 0

"""``labkit.lab.train_ranks``: the notebooks' ``labkit train`` on forked ranks reads its flags as the command line does
(the training itself runs in notebooks 03, 04 and 06)."""
import pytest

from labkit.errors import ConfigError
from labkit.lab.train_ranks import train_on_ranks
from labkit.train.cli import config_from_argv


def test_flags_become_the_config_the_command_line_builds():
    cfg = config_from_argv(["--strategy", "pipeline", "--schedule", "1f1b", "--num-microbatches", "4",
                            "--model", "resnet20", "--batch-size", "64", "--max-steps", "4", "--no-checkpoint",
                            "--out", "runs/x"])
    assert (cfg.strategy, cfg.model, cfg.batch_size, cfg.max_steps, cfg.checkpoint, cfg.out) == (
        "pipeline", "resnet20", 64, 4, False, "runs/x")
    assert cfg.strategy_options["schedule"] == "1f1b" and cfg.strategy_options["num_microbatches"] == 4
    kfac = config_from_argv(["--strategy", "ddp", "--optimizer", "kfac", "--kfac-update-freq", "4"])
    assert kfac.optimizer == "kfac" and kfac.optim_options["kfac_update_freq"] == 4


def test_bad_input_stops_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit) as stop:
        train_on_ranks(["--strategy", "ddp", "--schedule", "1f1b"], nproc=2)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error: --schedule is a flag of --strategy pipeline")
    with pytest.raises(ConfigError, match="--lr-decay epochs must be increasing"):
        train_on_ranks(["--lr-decay", "5", "3"], nproc=2)

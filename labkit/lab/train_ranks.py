"""``labkit train`` on gloo CPU ranks forked by :func:`labkit.dist.testing.run_ranks`, for notebooks.

    run = train_on_ranks(["--strategy", "ddp", "--model", "lenet", "--out", "runs/x"], nproc=2)

Each rank runs the same :func:`labkit.train.run.run` that ``torchrun --nproc_per_node 2 -m labkit train ...``
starts, with the same flags, on a process group of ``nproc`` ranks, and writes the same results folder. What
differs is only how the ranks start: forked from a process that imported torch once, instead of a launcher
agent and ``nproc`` fresh Pythons that each import torch (seconds of CPU each on a laptop).
"""
from __future__ import annotations

from typing import Sequence

from labkit.dist.testing import run_ranks
from labkit.results import Run, load_run
from labkit.train.cli import config_from_argv


def train_on_ranks(args: Sequence[str], nproc: int = 2, *, timeout: float = 600.0) -> Run:
    """Train ``labkit train ARGS`` on ``nproc`` forked gloo ranks and load its results folder (``--out``).

    A bad flag or configuration stops here, before any rank starts (``SystemExit(2)`` with one line for a
    flag, :class:`labkit.errors.ConfigError` for a value).
    """
    cfg = config_from_argv(list(args))
    cfg.validate()
    run_ranks(_train, nproc, cfg, timeout=timeout)
    return load_run(cfg.out_dir)


def _train(env, cfg) -> None:
    from labkit.train.run import run

    run(cfg, env=env)

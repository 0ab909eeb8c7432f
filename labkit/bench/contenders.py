"""The two kinds of benchmark contender: labkit through :func:`labkit.train.loop.fit`, and plain PyTorch.

The plain baselines are written the way a performance-aware user writes them: the dataset is decoded once
and held as one normalised float tensor on the device, every call draws a permutation and slices batches
out of it (a data-parallel rank takes every ``world``-th index of the same permutation, as
DistributedSampler does), and the step is zero_grad / forward / loss / backward / step, nothing else.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import ConfigError


def preload(name: str, device: torch.device | str, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Dataset ``name`` decoded and normalised once: ``(x (N, C, H, W) float32, y (N,) int64)`` on ``device``."""
    from labkit.data import datasets as data

    dataset = data.get_dataset(name, train=train)
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    y = torch.tensor([dataset[i][1] for i in range(len(dataset))])
    return x.to(device), y.to(device)


class PlainLoop:
    """``steps`` textbook steps over preloaded tensors per call; returns the samples of the whole job.

    Args:
        model: a module (or DDP / GPipe wrapper) that takes ``x`` on ``x.device`` and returns logits (a language
            model's (B, T, V) against targets (B, T)).
        x, y: the preloaded split; ``y`` on the device the logits come out on.
        batch_size: samples per step on this rank.
        steps: steps per call.
        rank, world: this rank's shard of each permutation (every ``world``-th index from ``rank``).
        optimizer: ``sgd`` (momentum 0.9) or ``adam``.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, steps: int,
                 rank: int = 0, world: int = 1, lr: float = 0.01, seed: int = 0, optimizer: str = "sgd"):
        if steps * batch_size * world > len(x):
            raise ConfigError(f"{steps} steps of {batch_size} samples on {world} rank(s) need "
                              f"{steps * batch_size * world} samples; the dataset has {len(x)}: use fewer --steps")
        self.model, self.x, self.y = model, x, y
        self.batch_size, self.steps, self.rank, self.world = batch_size, steps, rank, world
        self.optimizer = (torch.optim.Adam(model.parameters(), lr=lr) if optimizer == "adam"
                          else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
        self.generator = torch.Generator().manual_seed(seed)  # the same permutation on every rank

    def __call__(self) -> int:
        shard = torch.randperm(len(self.x), generator=self.generator)[self.rank::self.world].to(self.x.device)
        self.model.train()
        b = self.batch_size
        for i in range(self.steps):
            index = shard[i * b:(i + 1) * b]
            x, y = self.x[index], self.y[index.to(self.y.device)]
            self.optimizer.zero_grad(set_to_none=True)
            logits = self.model(x)
            F.cross_entropy(logits.flatten(0, -2), y.flatten()).backward()
            self.optimizer.step()
        return self.steps * b * self.world


def labkit_fit(model: nn.Module, loader, strategy, steps: int | None, lr: float = 0.01, epochs: int = 1,
               as_train: bool = False, **fit_options) -> Callable[[], int]:
    """A contender that trains ``epochs`` epochs of ``steps`` steps (None: whole epochs) per call through
    :func:`labkit.train.loop.fit`, with the strategy's own optimizer (SGD, momentum 0.9).

    ``as_train``: everything ``labkit train`` adds around a step as well: the learning-rate scheduler, the stop
    signals (with a checkpoint, the default) and the utilisation monitor's sampling thread; not the
    checkpoints, the evaluation or the result files, which the plain loop has no counterpart of.
    """
    from labkit.optim import OptimizerSpec
    from labkit.train.loop import fit
    from labkit.train.monitor import UtilisationMonitor
    from labkit.train.preempt import StopSignals

    optimizer, _ = strategy.build_optimizer(model, OptimizerSpec("sgd", lr, 0.9, env=strategy.env))
    if steps is not None and steps > len(loader):
        raise ConfigError(f"--steps {steps} is more than the {len(loader)} batches of an epoch; use fewer --steps")
    per_epoch = len(loader) if steps is None else steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0) if as_train else None

    def call() -> int:
        with (UtilisationMonitor(interval_s=1.0) if as_train else contextlib.nullcontext()), \
                (StopSignals() if as_train else contextlib.nullcontext()) as stop:
            fit(model, loader, None, optimizer, epochs=epochs, strategy=strategy, max_steps=steps, log_every=10 ** 9,
                printer=lambda line: None, **{"scheduler": scheduler, "stop": stop, **fit_options})
        return epochs * per_epoch * loader.batch_size * strategy.data_parallel_size

    return call

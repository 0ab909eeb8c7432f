"""The strategy interface: where the model and data live and how gradients meet.

A strategy never runs its own training loop; :func:`labkit.train.fit` calls these methods in order::

    model = strategy.prepare(model)
    for epoch: strategy.set_epoch(epoch)
        for x, y: loss, out = strategy.forward_backward(model, x, y, criterion)
                  strategy.sync_gradients(model); [preconditioner.step()]; optimizer.step()
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Sampler

from labkit.dist import DistEnv


class Strategy:
    """One device, or every rank training its own full copy with no communication.

    Subclasses override what differs; the defaults are the single-device behaviour.

    Args:
        env: this process's place in the job.
        options: the strategy's own command-line options (``add_arguments``), by ``dest`` name.
    """

    name = "single"
    #: build the model as a flat nn.Sequential (needed to cut it into stages)
    sequential_model = False
    #: every rank holds the same parameters (rank 0 alone writes checkpoints); False: each rank its own part
    replicated = True

    def __init__(self, env: DistEnv, options: dict | None = None):
        self.env = env
        self.options = dict(options or {})

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        """Add this strategy's own ``labkit train`` flags (none for the single-device strategy)."""

    @property
    def input_device(self) -> torch.device:
        return self.env.device

    @property
    def target_device(self) -> torch.device:
        return self.env.device

    @property
    def data_parallel_size(self) -> int:
        """How many ranks each see a different shard of every batch (global batch = this × per-rank batch)."""
        return 1

    def per_rank_batch_size(self, batch_size: int) -> int:
        """This rank's batch given ``--batch-size``; a strategy may derive it from its own flags instead."""
        return batch_size

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.env.device)

    def sampler(self, dataset: Dataset, train: bool, seed: int) -> Sampler | None:
        return None

    def set_epoch(self, epoch: int) -> None:
        pass

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return model(x)

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        out = model(x)           # (B, num_classes)
        loss = criterion(out, y)
        loss.backward()
        return loss.detach(), out.detach()

    def sync_gradients(self, model: nn.Module) -> None:
        pass

    def metric_owner(self) -> bool:
        return True

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def devices(self) -> list[torch.device]:
        return [self.env.device]

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small metrics tensor over every rank of the job (identity for one process)."""
        if self.env.distributed:
            values = values.to(self.env.device)
            dist.all_reduce(values)
            values = values.cpu()
        return values

    def close(self) -> None:
        pass

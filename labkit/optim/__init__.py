"""Optimizers and gradient preconditioners for the training loop.

``kfac`` is SGD whose gradients K-FAC preconditions in place between ``backward`` and ``step``
(so K-FAC also works with Adam or any other torch optimizer when used from Python).
"""
from __future__ import annotations

import argparse
import importlib

import torch
from torch import nn

from labkit.dist import DistEnv
from labkit.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "kfac")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The preconditioners' own ``labkit train`` flags (K-FAC's ``--kfac-*``)."""
    importlib.import_module("labkit.optim.kfac").add_arguments(group)


def build_optimizer(name: str, model: nn.Module, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                    options: dict | None = None, env: DistEnv | None = None):
    """Return ``(optimizer, preconditioner or None)`` for ``name`` in :data:`OPTIMIZERS`.

    ``options`` are the ``--kfac-*`` values; ``kfac`` with ``kfac_update_freq == 0`` is plain SGD, as in
    the seed-004 command line.
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
    if lr <= 0:
        raise ConfigError(f"learning rate must be > 0, got {lr}")
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay), None
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "kfac":
        kfac = importlib.import_module("labkit.optim.kfac")
        return optimizer, kfac.from_options(model, dict(options or {}), env, optimizer=optimizer)
    return optimizer, None

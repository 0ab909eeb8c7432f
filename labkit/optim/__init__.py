"""Optimizers and gradient preconditioners for the training loop.

``kfac`` is SGD whose gradients K-FAC preconditions in place between ``backward`` and ``step``
(so K-FAC also works with Adam or any other torch optimizer when used from Python).

This package imports no torch at import time: ``labkit train`` reads :data:`OPTIMIZERS` and the optimizers'
flags before deciding whether to train at all.
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from labkit.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from labkit.dist import DistEnv

#: optimizer name -> torch-free module whose ``add_arguments(group)`` adds its own ``labkit train`` flags
OPTIMIZERS: dict[str, str | None] = {"sgd": None, "adam": None, "kfac": "labkit.optim.kfac_options"}


def add_arguments(group: argparse._ArgumentGroup, name: str = "kfac") -> None:
    """Add optimizer ``name``'s own ``labkit train`` flags (K-FAC's ``--kfac-*``; none for sgd and adam)."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
    if OPTIMIZERS[name]:
        importlib.import_module(OPTIMIZERS[name]).add_arguments(group)


def build_optimizer(name: str, model: nn.Module, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                    options: dict | None = None, env: DistEnv | None = None):
    """Return ``(optimizer, preconditioner or None)`` for ``name`` in :data:`OPTIMIZERS`.

    ``options`` are the ``--kfac-*`` values; ``kfac`` with ``kfac_update_freq == 0`` is plain SGD, as in
    the seed-004 command line.
    """
    import torch

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


@dataclass
class OptimizerSpec:
    """What ``--optimizer`` and its flags ask for, to be built over whichever module a strategy chooses.

    :meth:`labkit.strategies.base.Strategy.build_optimizer` receives this: a replicated strategy builds it
    over the whole model, a sharded one over the part its rank owns.
    """

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    options: dict = field(default_factory=dict)
    env: Any = None

    def build(self, module: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        """``(optimizer, preconditioner or None)`` over ``module``'s trainable parameters."""
        return build_optimizer(self.name, module, self.lr, self.momentum, self.weight_decay, self.options, self.env)

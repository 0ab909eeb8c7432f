"""Optimizers and gradient preconditioners for the training loop.

``sgd``, ``adam``, ``lars`` and ``lamb`` are optimizers; ``kfac`` is K-FAC preconditioning the gradients in
place between ``backward`` and ``step`` of a *base* optimizer (``--kfac-base sgd|adam|lars|lamb``, default
SGD as in the seed's command line). ``shampoo``, ``soap`` and ``muon`` keep whole-matrix state and split it over
the data-parallel ranks (:mod:`labkit.optim.split`).

A registry entry is ``"module:function"`` (a torch-free function that adds the optimizer's flags; the optimizer
is built here) or a plain ``"module"`` that declares its flags as a ``FLAGS`` literal (:mod:`labkit.flags`, read
without importing it) and has ``build(model, lr, momentum, weight_decay, options)``: a new optimizer of that
kind is one module and one line.

This package imports no torch at import time: ``labkit train`` reads :data:`OPTIMIZERS` and the optimizers'
flags before deciding whether to train at all.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from labkit.errors import ConfigError
from labkit.flags import add_flags, defaults, read_flags, resolve
from labkit.optim.trust_options import BASES, DEFAULTS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from labkit.dist.group import DistEnv

#: optimizer name -> torch-free ``"module:function"`` that adds its own ``labkit train`` flags to a group
OPTIMIZERS: dict[str, str | None] = {"sgd": None, "adam": None,
                                     "lars": "labkit.optim.trust_options:add_lars_arguments",
                                     "lamb": "labkit.optim.trust_options:add_lamb_arguments",
                                     "kfac": "labkit.optim.trust_options:add_kfac_arguments",
                                     "shampoo": "labkit.optim.shampoo",
                                     "soap": "labkit.optim.soap",
                                     "muon": "labkit.optim.muon"}


def add_arguments(group: argparse._ArgumentGroup, name: str = "kfac") -> None:
    """Add optimizer ``name``'s own ``labkit train`` flags (K-FAC's ``--kfac-*``, LARS's, LAMB's; none for sgd
    and adam)."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
    entry = OPTIMIZERS[name]
    if entry and ":" not in entry:
        add_flags(group, read_flags(entry))
    elif entry:
        resolve(entry)(group)


def build_optimizer(name: str, model: nn.Module, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                    options: dict | None = None, env: DistEnv | None = None):
    """Return ``(optimizer, preconditioner or None)`` for ``name`` in :data:`OPTIMIZERS`.

    ``options`` are the ``--kfac-*``, ``--lars-*``, ``--lamb-*`` values by dest; ``kfac`` with
    ``kfac_update_freq == 0`` is its base optimizer alone, as in the seed-004 command line.
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
    if lr <= 0:
        raise ConfigError(f"learning rate must be > 0, got {lr}")
    given = {k: v for k, v in dict(options or {}).items() if v is not None}
    entry = OPTIMIZERS[name]
    if entry and ":" not in entry:
        try:
            return resolve(f"{entry}:build")(model, lr, momentum, weight_decay,
                                             {**defaults(read_flags(entry)), **given}), None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    options = {**DEFAULTS, **given}
    base = options["kfac_base"] if name == "kfac" else name
    if base not in BASES:
        raise ConfigError(f"unknown --kfac-base {base!r}; choose one of: {', '.join(BASES)}")
    try:
        optimizer = _base_optimizer(base, model, lr, momentum, weight_decay, options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if name == "kfac":
        from labkit.optim.kfac.preconditioner import from_options  # torch: only when K-FAC is asked for

        return optimizer, from_options(model, options, env, optimizer=optimizer)
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


def _base_optimizer(name: str, model: nn.Module, lr: float, momentum: float, weight_decay: float,
                    options: dict) -> torch.optim.Optimizer:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    from labkit.optim.lars import param_groups

    groups = param_groups(model, weight_decay, exclude_bias_and_norm=not options["trust_all_params"])
    if name == "lars":
        from labkit.optim.lars import LARS

        return LARS(groups, lr=lr, momentum=momentum, trust_coefficient=options["lars_trust_coefficient"])
    from labkit.optim.lamb import LAMB

    return LAMB(groups, lr=lr, betas=tuple(options["lamb_betas"]), eps=options["lamb_eps"])

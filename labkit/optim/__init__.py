"""Optimizers and gradient preconditioners for the training loop.

``sgd``, ``adam``, ``lars`` and ``lamb`` are optimizers; ``kfac`` is K-FAC preconditioning the gradients in
place between ``backward`` and ``step`` of a *base* optimizer (``--kfac-base sgd|adam|lars|lamb``, default
SGD as in the seed's command line).
"""
from __future__ import annotations

import argparse
import importlib

import torch
from torch import nn

from labkit.dist import DistEnv
from labkit.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "lars", "lamb", "kfac")
BASES = ("sgd", "adam", "lars", "lamb")
#: LARS/LAMB flags (by dest) -> default
DEFAULTS = {"kfac_base": "sgd", "lars_trust_coefficient": 0.001, "lamb_betas": (0.9, 0.999), "lamb_eps": 1e-6,
            "trust_all_params": False}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The optimizers' own ``labkit train`` flags: K-FAC's ``--kfac-*``, LARS's and LAMB's."""
    importlib.import_module("labkit.optim.kfac").add_arguments(group)
    group.add_argument("--kfac-base", default=DEFAULTS["kfac_base"], choices=BASES,
                       help="the optimizer K-FAC's preconditioned gradients feed (default sgd)")
    group.add_argument("--lars-trust-coefficient", type=float, default=DEFAULTS["lars_trust_coefficient"],
                       metavar="ETA", help="LARS trust coefficient η (default 0.001)")
    group.add_argument("--lamb-betas", type=float, nargs=2, default=DEFAULTS["lamb_betas"], metavar=("B1", "B2"),
                       help="LAMB moment decays (default 0.9 0.999)")
    group.add_argument("--lamb-eps", type=float, default=DEFAULTS["lamb_eps"], help="LAMB ε (default 1e-6)")
    group.add_argument("--trust-all-params", action="store_true",
                       help="LARS/LAMB: apply the trust ratio and weight decay to biases and norm layers too "
                            "(excluded by default)")


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
    options = {**DEFAULTS, **{k: v for k, v in dict(options or {}).items() if v is not None}}
    base = options["kfac_base"] if name == "kfac" else name
    if base not in BASES:
        raise ConfigError(f"unknown --kfac-base {base!r}; choose one of: {', '.join(BASES)}")
    try:
        optimizer = _base_optimizer(base, model, lr, momentum, weight_decay, options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if name == "kfac":
        kfac = importlib.import_module("labkit.optim.kfac")
        return optimizer, kfac.from_options(model, options, env, optimizer=optimizer)
    return optimizer, None


def _base_optimizer(name: str, model: nn.Module, lr: float, momentum: float, weight_decay: float,
                    options: dict) -> torch.optim.Optimizer:
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

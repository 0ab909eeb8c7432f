"""The flags of the layer-wise trust-ratio optimizers (LARS, LAMB) and of K-FAC's base optimizer.

Torch-free, like :mod:`labkit.optim.kfac.options`: ``labkit train`` reads them before it imports torch.
"""
from __future__ import annotations

import argparse

from labkit.ranges import within

BASES = ("sgd", "adam", "lars", "lamb")
#: LARS/LAMB/K-FAC-base flags (by dest) -> default
DEFAULTS = {"kfac_base": "sgd", "lars_trust_coefficient": 0.001, "lamb_betas": (0.9, 0.999), "lamb_eps": 1e-6,
            "trust_all_params": False}


def _add_trust_all(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--trust-all-params", action="store_true",
                       help="apply the trust ratio and weight decay to biases and norm layers too "
                            "(excluded by default)")


def add_lars_arguments(group: argparse._ArgumentGroup) -> None:
    """``--optimizer lars``: the trust coefficient η and ``--trust-all-params``."""
    group.add_argument("--lars-trust-coefficient", type=within("float", "(0, inf)"),
                       default=DEFAULTS["lars_trust_coefficient"],
                       metavar="ETA", help="LARS trust coefficient η (default 0.001)")
    _add_trust_all(group)


def add_lamb_arguments(group: argparse._ArgumentGroup) -> None:
    """``--optimizer lamb``: Adam's moment decays and ε, and ``--trust-all-params``."""
    group.add_argument("--lamb-betas", type=within("float", "[0, 1)"),
                       nargs=2, default=DEFAULTS["lamb_betas"], metavar=("B1", "B2"),
                       help="LAMB moment decays (default 0.9 0.999)")
    group.add_argument("--lamb-eps", type=within("float", "(0, inf)"),
                       default=DEFAULTS["lamb_eps"], help="LAMB ε (default 1e-6)")


def add_kfac_arguments(group: argparse._ArgumentGroup) -> None:
    """``--optimizer kfac``: K-FAC's ``--kfac-*`` flags, ``--kfac-base`` and the flags of every base it can feed."""
    from labkit.optim.kfac import options as kfac_options

    kfac_options.add_arguments(group)
    group.add_argument("--kfac-grad-worker-fraction", type=within("float", "(0, 1]"), default=None, metavar="F",
                       help="KAISA: fraction of ranks holding each layer's decomposition, 1/W (least memory) .. 1 "
                            "(least traffic); f·W must divide W; replaces --kfac-broadcast (default: not used)")
    group.add_argument("--kfac-base", default=DEFAULTS["kfac_base"], choices=BASES,
                       help="the optimizer K-FAC's preconditioned gradients feed (default sgd)")
    group.add_argument("--lars-trust-coefficient", type=within("float", "(0, inf)"),
                       default=DEFAULTS["lars_trust_coefficient"],
                       metavar="ETA", help="with --kfac-base lars: LARS trust coefficient η (default 0.001)")
    add_lamb_arguments(group)
    _add_trust_all(group)

"""K-FAC's knobs: their ``labkit train`` flags, defaults, and the checks that turn bad values into one clear error.

``--kfac-update-freq K`` is the seed's flag: every K steps K-FAC refreshes its Kronecker factors and their
decompositions (``--kfac-inv-update-freq M`` decomposes every M steps instead); ``0`` means plain SGD, as in
the seed's command line. The 2021 kfac_pytorch updated the factors every step and decomposed every K steps:
``--kfac-update-freq 1 --kfac-inv-update-freq 10`` does that (dearer: the factors of a convolution cost
more than its forward pass, see ``labkit bench kfac``). Factor decay 0.95 and KL clip 0.001 are the
kfac_pytorch CIFAR-10 defaults.

**Damping and the scale of the factors.** labkit's factors are on the textbook scale: ``A ⊗ G`` is the
Fisher block of the layer (see :mod:`labkit.optim.kfac.layers`). kfac_pytorch's are smaller by N² for a
Linear layer and N²·T⁵ for a Conv2d (N the per-rank batch, T the output positions), and damping adds to the
eigenvalues of that product, so the same number damps far less here. kfac_pytorch's 0.003 at batch N
corresponds to ``γ = 0.003·N²`` here for a Linear layer (12 at N = 64); no single number converts for
every layer. Measured on LeNet / mnist-sample (batch 64, SGD lr 0.05, 62 steps): γ = 0.003 with the factors
refreshed every step drives the logits to |z| ≈ 1,360 (mean loss 5.8 over the last ten steps, peaks of 27),
γ = 0.03 keeps them at 36 and γ = 0.3 at 24 (every 10 steps: 79, 29, 21); the MLP: 206 / 72 / 30 (every
10 steps: 102 / 44 / 25, and only γ = 0.3 never lets the loss rise above its start at either frequency);
ResNet-20 on synthetic-cifar10 at γ = 0.3 every 10 steps: 14 over 30 steps. The default, 0.3, leaves margin
for the convolutional nets, whose factors are larger still.
"""
from __future__ import annotations

import argparse
from enum import Enum

from labkit.errors import ConfigError
from labkit.ranges import within


class Method(str, Enum):
    """How the damped factors are inverted (see :mod:`labkit.optim.kfac.preconditioner`)."""

    EIGEN = "eigen"
    INVERSE = "inverse"


class Approx(str, Enum):
    """How Conv2d spatial positions enter the factors (see :mod:`labkit.optim.kfac.layers`)."""

    EXPAND = "expand"
    REDUCE = "reduce"


class Broadcast(str, Enum):
    """What a layer's owner rank shares after decomposing (see :mod:`labkit.optim.kfac.distributed`)."""

    DECOMPOSITIONS = "decompositions"
    GRADIENTS = "gradients"


#: ``--kfac-*`` dest -> default
DEFAULTS = {"kfac_update_freq": 10, "kfac_inv_update_freq": None, "kfac_damping": 0.3, "kfac_factor_decay": 0.95,
            "kfac_kl_clip": 0.001, "kfac_method": Method.EIGEN.value, "kfac_approx": Approx.EXPAND.value,
            "kfac_broadcast": Broadcast.DECOMPOSITIONS.value}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Add the ``--kfac-*`` flags to a ``labkit train`` argument group."""
    group.add_argument("--kfac-update-freq", type=within("int", "[0, inf)"),
                       default=DEFAULTS["kfac_update_freq"], metavar="STEPS",
                       help="steps between K-FAC updates of the Kronecker factors (and, unless "
                            "--kfac-inv-update-freq says otherwise, of their decompositions); "
                            "0 = plain SGD (default 10)")
    group.add_argument("--kfac-inv-update-freq", type=within("int", "[1, inf)"),
                       default=DEFAULTS["kfac_inv_update_freq"], metavar="STEPS",
                       help="steps between decompositions (eigen/inverse), if not every --kfac-update-freq steps")
    group.add_argument("--kfac-damping", type=within("float", "(0, inf)"),
                       default=DEFAULTS["kfac_damping"],
                       help="damping γ on the textbook scale of the factors (default 0.3; kfac_pytorch's γ ≈ this / N² "
                            "for a Linear layer, N the per-rank batch)")
    group.add_argument("--kfac-factor-decay", type=within("float", "[0, 1)"), default=DEFAULTS["kfac_factor_decay"],
                       help="running-average weight of the old factors (default 0.95)")
    group.add_argument("--kfac-kl-clip", type=within("float", "[0, inf)"), default=DEFAULTS["kfac_kl_clip"],
                       help="KL clipping κ; 0 disables it (default 0.001)")
    group.add_argument("--kfac-method", default=DEFAULTS["kfac_method"], choices=[m.value for m in Method],
                       help="eigendecompositions (exact damping) or damped inverses (cheaper)")
    group.add_argument("--kfac-approx", default=DEFAULTS["kfac_approx"], choices=[a.value for a in Approx],
                       help="Conv2d factors: expand (every kernel position, Grosse & Martens 2016) or reduce "
                            "(positions averaged first, Eschenhagen et al. 2023: much cheaper; its factors have rank "
                            "at most the batch size, so it may want more damping than expand)")
    group.add_argument("--kfac-broadcast", default=DEFAULTS["kfac_broadcast"], choices=[b.value for b in Broadcast],
                       help="several ranks: share decompositions on update steps (less traffic) or preconditioned "
                            "gradients every step (less memory)")


def parse_enum(kind: type[Enum], value, flag: str):
    """``kind(value)``, or a :class:`ConfigError` naming the flag and the choices."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(m.value for m in kind)}") from None


def validate(damping: float, factor_decay: float, kl_clip: float, factor_update_freq: int,
             inv_update_freq: int) -> None:
    """Raise :class:`ConfigError` naming the first bad value, its flag, and a sensible value."""
    if not damping > 0:
        raise ConfigError(f"K-FAC damping must be > 0, got {damping} (--kfac-damping); try 0.3")
    if not 0 <= factor_decay < 1:
        raise ConfigError(f"K-FAC factor decay must be in [0, 1), got {factor_decay} (--kfac-factor-decay); try 0.95")
    if not kl_clip >= 0:
        raise ConfigError(f"K-FAC KL clip must be >= 0 (0 disables it), got {kl_clip} (--kfac-kl-clip); try 0.001")
    for flag, freq in (("--kfac-update-freq", factor_update_freq), ("--kfac-inv-update-freq", inv_update_freq)):
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ConfigError(f"K-FAC {flag} must be an integer >= 1 here, got {freq!r}")


def kwargs_from_options(options: dict) -> dict | None:
    """``--kfac-*`` values (by dest) -> :class:`~labkit.optim.kfac.preconditioner.KFAC` keyword arguments; ``None`` for
    ``kfac_update_freq == 0`` (plain SGD)."""
    values = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    freq = values["kfac_update_freq"]
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 0:
        raise ConfigError(f"--kfac-update-freq must be an integer >= 0 (0 = plain SGD), got {freq!r}")
    if freq == 0:
        return None
    return {"damping": values["kfac_damping"], "factor_decay": values["kfac_factor_decay"],
            "kl_clip": values["kfac_kl_clip"], "factor_update_freq": freq,
            "inv_update_freq": values["kfac_inv_update_freq"] or freq, "method": values["kfac_method"],
            "approx": values["kfac_approx"], "broadcast": values["kfac_broadcast"]}

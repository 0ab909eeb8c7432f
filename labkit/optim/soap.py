r"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in the eigenbasis of
Shampoo's preconditioner.

Shampoo with the power −1/2 equals Adafactor in the eigenbasis of L and R; SOAP runs full Adam there instead, so
the eigenbasis may be refreshed rarely while the second moment adapts every step. For a parameter W viewed as an
(m, n) matrix (:func:`labkit.optim.shampoo.as_matrix`) with gradient G = ∇W, in the order :meth:`SOAP.step`
codes it::

    L  ← β_s L + (1−β_s) G Gᵀ,   R ← β_s R + (1−β_s) Gᵀ G      Shampoo's statistics, β_s = shampoo_beta
    every F steps (and on the first):
        Q_L, Q_R ← eigenvectors of L and R (eigh)              a side longer than max_dim keeps Q = I
    M  ← β₁ M + (1−β₁) G                                       Adam's first moment, in W's own basis
    G' = Q_Lᵀ G Q_R,   M' = Q_Lᵀ M Q_R                         both rotated into the eigenbasis
    V  ← β₂ V + (1−β₂) G'²                                     Adam's second moment, in the eigenbasis
    N' = (M' / (1−β₁ᵗ)) / (√(V / (1−β₂ᵗ)) + ε)                 Adam's normalised step there
    N  = Q_L N' Q_Rᵀ                                           rotated back
    W  ← W − η λ W − η N                                       decoupled weight decay λ (AdamW), rate η

A one-dimensional parameter (a bias) has Q = I on both sides: plain AdamW.

What the reference implementation (nikhilvyas/SOAP) does that this one does not: after the first
eigendecomposition it refreshes the bases by one step of power iteration and a QR decomposition (cheaper than
eigh), it carries V over to the new basis by reordering its entries, it merges small dimensions of higher-order
tensors instead of flattening them to (out, rest), and it skips the parameter update on the very first step.

Under ``torch.distributed`` each rank steps only the parameters it owns and broadcasts them
(:mod:`labkit.optim.split`; ``--soap-worker-fraction`` f: each group of 1/f ranks
holds one copy of the state).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from labkit.optim.kfac.linalg import symmetric_eigen
from labkit.optim.shampoo import as_matrix, matrix_cost
from labkit.optim.split import SplitOptimizer

FLAGS = [
    {"flag": "--soap-update-freq", "type": "int", "range": "[1, inf)", "default": 10, "metavar": "STEPS",
     "help": "steps between the eigendecompositions of L and R (the eigenbasis)"},
    {"flag": "--soap-betas", "type": "float", "range": "[0, 1)", "nargs": 2, "default": [0.95, 0.95],
     "metavar": ("B1", "B2"), "help": "Adam's moment decays β₁ β₂ in the eigenbasis (default 0.95 0.95, the paper's)"},
    {"flag": "--soap-shampoo-beta", "type": "float", "range": "[0, 1)", "default": 0.95, "metavar": "BETA",
     "help": "running-average weight of the old L and R"},
    {"flag": "--soap-eps", "type": "float", "range": "(0, inf)", "default": 1e-8, "help": "Adam's ε"},
    {"flag": "--soap-max-dim", "type": "int", "range": "[1, inf)", "default": 1024, "metavar": "D",
     "help": "a side longer than D keeps the identity basis"},
    {"flag": "--soap-worker-fraction", "type": "float", "range": "(0, 1]", "default": None, "metavar": "F",
     "help": "several ranks: the fraction of them holding each matrix's state and step, 1/W (default: one owner, "
             "the least memory) .. 1 (every rank steps every matrix, nothing travels); f·W must divide W, as "
             "--kfac-grad-worker-fraction"},
]


class SOAP(SplitOptimizer):
    """Adam in Shampoo's eigenbasis (formulas in the module docstring).

    Args:
        params: parameters (one list, or groups).
        lr: η > 0.
        betas: (β₁, β₂) in [0, 1).
        shampoo_beta: β_s in [0, 1).
        eps: ε > 0.
        weight_decay: λ >= 0 (decoupled).
        update_freq: F >= 1, steps between eigendecompositions.
        max_dim: sides longer than this keep the identity basis.
        distributed: split over the ranks (:mod:`labkit.optim.split`); None: when several ranks are running.
        worker_fraction: f, the fraction of the ranks holding each parameter's state; None: 1/W, one owner.
    """

    name = "soap"

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.95, 0.95), shampoo_beta: float = 0.95,
                 eps: float = 1e-8, weight_decay: float = 0.0, update_freq: int = 10, max_dim: int = 1024,
                 distributed: bool | None = None, worker_fraction: float | None = None):
        if not lr > 0:
            raise ValueError(f"SOAP learning rate must be > 0, got {lr}")
        if not all(0 <= b < 1 for b in (*betas, shampoo_beta)):
            raise ValueError(f"SOAP betas must be in [0, 1), got {tuple(betas)} and {shampoo_beta}")
        if not eps > 0 or not weight_decay >= 0:
            raise ValueError(f"SOAP ε must be > 0 and weight decay >= 0, got {eps} and {weight_decay}")
        if isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1:
            raise ValueError(f"SOAP update frequency must be an integer >= 1, got {update_freq!r}")
        defaults = dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
                        update_freq=update_freq, max_dim=max_dim)
        super().__init__(params, defaults)
        self._split([matrix_cost(p, g["max_dim"]) for g in self.param_groups for p in g["params"]], distributed,
                    worker_fraction)

    def _step_one(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        (b1, b2), bs = group["betas"], group["shampoo_beta"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(as_matrix(p) if p.ndim >= 2 else p)
        t = state["step"] = state["step"] + 1
        grad = p.grad
        g = as_matrix(grad) if p.ndim >= 2 else grad
        bases = {}
        if p.ndim >= 2:
            for key, d, outer in (("L", g.shape[0], lambda: g @ g.t()), ("R", g.shape[1], lambda: g.t() @ g)):
                if d > group["max_dim"]:
                    continue
                if key not in state:
                    state[key] = torch.zeros(d, d, dtype=g.dtype, device=g.device)
                state[key].mul_(bs).add_(outer(), alpha=1 - bs)                       # L ← β_s L + (1−β_s) GGᵀ
                if (t - 1) % group["update_freq"] == 0:                               # every F steps, and the first
                    state[f"Q_{key}"] = symmetric_eigen(state[key])[0]                # Q_L, Q_R
                bases[key] = state[f"Q_{key}"]
        state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)                            # M ← β₁M + (1−β₁)G
        m = as_matrix(state["exp_avg"]) if p.ndim >= 2 else state["exp_avg"]
        g_rot, m_rot = rotate(g, bases), rotate(m, bases)                             # G' = Q_LᵀGQ_R, M' likewise
        v = state["exp_avg_sq"].mul_(b2).addcmul_(g_rot, g_rot, value=1 - b2)        # V ← β₂V + (1−β₂)G'²
        step = (m_rot / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(group["eps"]))   # N'
        step = rotate_back(step, bases)                                               # N = Q_L N' Q_Rᵀ
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])                           # W ← W − ηλW
        p.sub_(step.reshape_as(p), alpha=group["lr"])                                 # W ← W − ηN


def rotate(x: Tensor, bases: dict[str, Tensor]) -> Tensor:
    """``Q_Lᵀ X Q_R`` (a missing side: identity)."""
    if "L" in bases:
        x = bases["L"].t() @ x
    if "R" in bases:
        x = x @ bases["R"]
    return x


def rotate_back(x: Tensor, bases: dict[str, Tensor]) -> Tensor:
    """``Q_L X Q_Rᵀ`` (a missing side: identity)."""
    if "L" in bases:
        x = bases["L"] @ x
    if "R" in bases:
        x = x @ bases["R"].t()
    return x


def build(model: nn.Module, lr: float, momentum: float, weight_decay: float, options: dict) -> SOAP:
    """``labkit train --optimizer soap``: SOAP over ``model``'s trainable parameters, from its flags (``--momentum``
    is not used: β₁ is ``--soap-betas``' first)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return SOAP(params, lr=lr, betas=tuple(options["soap_betas"]), shampoo_beta=options["soap_shampoo_beta"],
                eps=options["soap_eps"], weight_decay=weight_decay, update_freq=options["soap_update_freq"],
                max_dim=options["soap_max_dim"], worker_fraction=options.get("soap_worker_fraction"))

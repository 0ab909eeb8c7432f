r"""LAMB: layer-wise adaptive moments for large batches (You et al. 2020, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes").

LAMB is Adam's update rescaled per layer by a trust ratio, as LARS rescales SGD's. For a parameter tensor w
with gradient g at step t (counted from 1), in the order :meth:`LAMB.step` codes it::

    m ← β₁ m + (1 − β₁) g                          first moment
    v ← β₂ v + (1 − β₂) g²                         second moment
    m̂ = m / (1 − β₁ᵗ),  v̂ = v / (1 − β₂ᵗ)          bias correction
    r = m̂ / (√v̂ + ε)                               Adam's direction
    u = r + λ w                                    decoupled weight decay λ
    φ = ‖w‖ / ‖u‖                                  trust ratio; φ = 1 when ‖w‖ = 0 or ‖u‖ = 0
    w ← w − γ φ u                                  global learning rate γ (the schedule's)

Bias and normalisation parameters (1-d tensors) are excluded by default
(:func:`labkit.optim.lars.param_groups`): ``λ = 0`` and ``φ = 1`` for them, i.e. AdamW without decay.
"""
from __future__ import annotations

import torch
from torch import Tensor

from labkit.optim.lars import trust_ratio


class LAMB(torch.optim.Optimizer):
    """Adam moments with a layer-wise trust ratio (formulas in the module docstring).

    Args:
        params: parameters or groups; a group may set ``trust_ratio=False``.
        lr: γ (> 0).
        betas: (β₁, β₂), each in [0, 1).
        eps: ε > 0.
        weight_decay: λ >= 0.

    Attributes:
        last_ratios: after each step, ``{id(param): φ}`` as 0-d tensors.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, trust_ratio: bool = True):
        if not lr > 0:
            raise ValueError(f"LAMB learning rate must be > 0, got {lr}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"LAMB betas must be in [0, 1), got {betas}")
        if not eps > 0:
            raise ValueError(f"LAMB eps must be > 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"LAMB weight decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_ratio=trust_ratio))
        self.last_ratios: dict[int, Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)                    # m ← β₁ m + (1 − β₁) g
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)             # v ← β₂ v + (1 − β₂) g²
                m_hat = m / (1 - beta1 ** t)                              # m̂, v̂
                v_hat = v / (1 - beta2 ** t)
                r = m_hat / (v_hat.sqrt() + eps)                          # r = m̂ / (√v̂ + ε)
                u = r.add(p, alpha=decay) if decay else r                 # u = r + λ w
                if group["trust_ratio"]:
                    w_norm = torch.linalg.vector_norm(p)
                    u_norm = torch.linalg.vector_norm(u)
                    ratio = trust_ratio(w_norm, u_norm, w_norm / u_norm)  # φ = ‖w‖ / ‖u‖
                else:
                    ratio = torch.ones((), dtype=p.dtype, device=p.device)
                self.last_ratios[id(p)] = ratio
                p.sub_(u * ratio, alpha=lr)                               # w ← w − γ φ u
        return loss

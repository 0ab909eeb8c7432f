r"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017, "Large Batch Training of
Convolutional Networks").

With a large global batch the same learning rate is too large for some layers and too small for others:
the ratio ‖w‖ / ‖∇w‖ differs by orders of magnitude between layers. LARS gives every layer (every
parameter tensor) its own *local* rate, proportional to that ratio. For a parameter tensor w with gradient
∇w, in the order :meth:`LARS.step` codes it::

    g  = ∇w + β w                                weight decay β
    λ  = η ‖w‖ / (‖∇w‖ + β ‖w‖)                  trust ratio (local rate); λ = 1 when ‖w‖ = 0 or ‖∇w‖ = 0
    v  ← m v + γ λ g                             momentum m, global learning rate γ (the schedule's)
    w  ← w − v

η is the *trust coefficient* (how far one step may move w relative to ‖w‖: about η γ). Bias and
normalisation parameters (1-d tensors) are excluded by default (:func:`param_groups`): for them
``β = 0`` and ``λ = 1``, i.e. plain SGD with momentum, as in the paper's reference implementations.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def param_groups(model: nn.Module, weight_decay: float, exclude_bias_and_norm: bool = True) -> list[dict]:
    """Two parameter groups: layers that get the trust ratio and weight decay, and the excluded ones.

    A parameter is *excluded* when it is 1-d: every bias, and the scales/shifts of BatchNorm, LayerNorm,
    GroupNorm. The excluded group has ``weight_decay=0`` and ``trust_ratio=False``.

    Returns:
        ``[{"params": [...], "weight_decay": β, "trust_ratio": True},
        {"params": [...], "weight_decay": 0.0, "trust_ratio": False}]`` (empty groups left out).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not exclude_bias_and_norm:
        return [{"params": params, "weight_decay": weight_decay, "trust_ratio": True}]
    layers = [p for p in params if p.ndim > 1]
    excluded = [p for p in params if p.ndim <= 1]
    groups = [{"params": layers, "weight_decay": weight_decay, "trust_ratio": True},
              {"params": excluded, "weight_decay": 0.0, "trust_ratio": False}]
    return [g for g in groups if g["params"]]


def trust_ratio(weight_norm: Tensor, other_norm: Tensor, ratio: Tensor) -> Tensor:
    """``ratio``, or 1 where ``weight_norm`` or ``other_norm`` is 0 (a zero layer, or no gradient/update)."""
    return torch.where((weight_norm > 0) & (other_norm > 0), ratio, torch.ones_like(ratio))


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio (formulas in the module docstring).

    Args:
        params: parameters or groups; a group may set ``trust_ratio=False`` (see :func:`param_groups`).
        lr: γ, the global learning rate (> 0).
        momentum: m in [0, 1).
        weight_decay: β >= 0.
        trust_coefficient: η > 0 (0.001 in the paper).

    Attributes:
        last_ratios: after each step, ``{id(param): λ}`` as 0-d tensors (for plots and tests).
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, trust_ratio: bool = True):
        if not lr > 0:
            raise ValueError(f"LARS learning rate must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"LARS momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0:
            raise ValueError(f"LARS weight decay must be >= 0, got {weight_decay}")
        if not trust_coefficient > 0:
            raise ValueError(f"LARS trust coefficient must be > 0, got {trust_coefficient}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        trust_ratio=trust_ratio)
        super().__init__(params, defaults)
        self.last_ratios: dict[int, Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, m, beta, eta = group["lr"], group["momentum"], group["weight_decay"], group["trust_coefficient"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                g = grad.add(p, alpha=beta) if beta else grad.clone()        # g = ∇w + β w
                if group["trust_ratio"]:
                    w_norm = torch.linalg.vector_norm(p)
                    g_norm = torch.linalg.vector_norm(grad)
                    # λ = η‖w‖ / (‖∇w‖ + β‖w‖)
                    ratio = trust_ratio(w_norm, g_norm, eta * w_norm / (g_norm + beta * w_norm))
                else:
                    ratio = torch.ones((), dtype=p.dtype, device=p.device)
                self.last_ratios[id(p)] = ratio
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                v = state["momentum_buffer"]
                v.mul_(m).add_(g * ratio, alpha=lr)                          # v ← m v + γ λ g
                p.sub_(v)                                                    # w ← w − v
        return loss

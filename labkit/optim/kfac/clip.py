"""KL clipping of the K-FAC step, and where it finds the learning rate.

Ba, Grosse & Martens (2017) bound how far one preconditioned step may move the model's output distribution:
with the preconditioned gradients P_ℓ, the raw gradients ∇W_ℓ and the learning rate α, every gradient is
scaled by

    ν = min(1, √(κ / (α² |Σ_ℓ ⟨P_ℓ, ∇W_ℓ⟩|)))

α is the rate the optimizer is about to use. It comes from, in order: the ``lr`` passed to
``KFAC.step(lr)``, the optimizer given to K-FAC, or (when none was given, as ``labkit train`` builds it)
the first optimizer that steps the model's parameters: a global optimizer-step pre-hook finds it and
applies that first step's clip just before the update, when the rate is known.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook


class KLClip:
    """Scales the preconditioned gradients by ν.

    Args:
        kappa: κ > 0.
        anchor: a parameter of the model (identifies the optimizer that steps it).
        scale: called with ν (a 0-d tensor) to multiply every preconditioned gradient in place.
        optimizer: where to read α; found automatically when omitted.
    """

    def __init__(self, kappa: float, anchor: nn.Parameter, scale: Callable[[Tensor], None],
                 optimizer: torch.optim.Optimizer | None = None):
        self.kappa, self.anchor, self.scale = kappa, anchor, scale
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending: Tensor | None = None
        self._hook = None
        if optimizer is not None:
            self.attach(optimizer)
        else:
            self._hook = register_optimizer_step_pre_hook(_finder(self))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Read α from ``optimizer`` (the param group holding ``anchor``) from now on."""
        self.optimizer = optimizer
        self.close()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def factor(self, vg: Tensor, lr: float) -> Tensor:
        """ν for ``vg = Σ⟨P, ∇W⟩``, as a tensor on vg's device (no host synchronisation)."""
        return torch.sqrt(self.kappa / (lr ** 2 * vg.abs()).clamp(min=1e-30)).clamp(max=1.0)

    def now(self, vg: Tensor, lr: float | None = None) -> Tensor | None:
        """ν if α is known now (the caller scales); else None, and ``scale`` gets ν just before the first
        optimizer step."""
        lr = lr if lr is not None else self.learning_rate()
        if lr is None:
            self._pending = vg
            return None
        return self.factor(vg, lr)

    def learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        group = next((g for g in self.optimizer.param_groups if any(p is self.anchor for p in g["params"])),
                     self.optimizer.param_groups[0])
        return float(group["lr"])

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if any(p is self.anchor for group in optimizer.param_groups for p in group["params"]):
            self.attach(optimizer)
            if self._pending is not None:
                self.scale(self.factor(self._pending, self.learning_rate()))
                self._pending = None


def inner_product(precond: list[Tensor], grads: list[Tensor], device: torch.device) -> Tensor:
    """``Σ_ℓ ⟨P_ℓ, ∇W_ℓ⟩`` as a 0-d tensor on ``device``: each layer's term on its own device (a pipeline's layers
    sit on different GPUs), then moved there; no host synchronisation."""
    return sum((p * g).sum().to(device) for p, g in zip(precond, grads))


def _finder(clip: KLClip):
    """The global optimizer-step pre-hook, holding ``clip`` weakly (a forgotten K-FAC can still be freed)."""
    ref = weakref.ref(clip)

    def hook(optimizer, args, kwargs) -> None:
        owner = ref()
        if owner is not None:
            owner._on_optimizer_step(optimizer)

    return hook

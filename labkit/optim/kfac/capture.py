"""What K-FAC's hooks record: each registered layer's input on the forward pass and its output's gradient on the
backward pass, on the steps that update the factors (:meth:`labkit.optim.kfac.layers.LayerFactors.capture_input`).

:class:`KFACCapture` is a base of :class:`labkit.optim.kfac.preconditioner.KFAC`, which registers the hooks.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from labkit.optim.kfac.layers import LayerFactors


class KFACCapture:
    """The forward and gradient hooks of :class:`labkit.optim.kfac.preconditioner.KFAC`, timed into ``timings["factors"]``."""

    def _capturing(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and self.steps % self.factor_update_freq == 0

    def _forward_hook(self, layer: LayerFactors, inputs: tuple, output: Tensor) -> None:
        if not inputs or not self._capturing(layer.module):
            return
        started = self._clock()
        with torch.autocast(inputs[0].device.type, enabled=False):  # factors in float32 even under torch.amp
            layer.capture_input(inputs[0])
        if output.requires_grad:
            output.register_hook(lambda grad: self._grad_hook(layer, grad))
        self.timings["factors"] += self._clock() - started

    def _grad_hook(self, layer: LayerFactors, grad: Tensor) -> None:
        started = self._clock()
        layer.capture_output_grad(grad)
        self.timings["factors"] += self._clock() - started

    def _clock(self) -> float:
        if self.timed and torch.cuda.is_available() and self.layers[0].module.weight.is_cuda:
            torch.cuda.synchronize()
        return self.clock()

"""Per-layer costs for splitting a sequential model into pipeline partitions: time, or bytes of parameters
plus the activations autograd saves for backward (:class:`SavedActivations`), and the balance that evens them.

    from labkit.strategies.balance import compute_balance, layer_costs
    compute_balance("memory", 2, model, batch, chunks=4, device=torch.device("cpu"))   # [layers, layers]
"""
from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn
from torchgpipe.balance import balance_cost
from torchgpipe.balance.profile import profile_sizes, profile_times

from labkit.errors import ConfigError
from labkit.strategies.stage_balance import without_hooks

BALANCE_METHODS = ("time", "memory")


class SavedActivations:
    """Live and peak bytes of the tensors autograd keeps for backward (the activations), on this thread.

        with SavedActivations(exclude=model.parameters()) as meter:
            model(x).sum().backward()
        meter.peak_bytes

    A saved tensor counts ``numel × element_size`` bytes (a view counts its own elements, so the
    micro-batch slices of one batch add up to the batch); the same memory saved twice (in-place ops)
    counts once; parameters (saved for the input gradients, but not activations) are excluded. Autograd
    frees a saved tensor after its backward, so ``live_bytes`` returns to zero after ``backward()``.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {p.data_ptr() for p in exclude}
        self._refs: Counter = Counter()  # (device, address, bytes) -> how many saved references
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.device, tensor.data_ptr(), nbytes)
        if tensor.data_ptr() in self._exclude or tensor.device.type == "meta":
            return _Held(tensor, None, key)
        if self._refs[key] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] += 1
        # detached: a saved output holding its own grad_fn would make a cycle (node -> held -> tensor -> node) that
        # keeps a graph dropped without backward (or kept by retain_graph, as a split backward keeps it) alive
        return _Held(tensor.detach(), self, key)

    def _release(self, key) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= key[2]

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor on its way through autograd; tells the meter when autograd lets go of it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivations | None, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        if self.meter is not None:
            self.meter._release(self.key)


def estimate_layer_memory(model: nn.Sequential, sample: torch.Tensor, param_scale: float = 2.0) -> list[int]:
    """Bytes per layer for training on one micro-batch ``sample`` (any device, no CUDA needed).

    ``size[i] = param_scale × bytes(parameters of layer i) + bytes autograd saves while layer i runs``.
    ``param_scale`` counts the copies an optimizer keeps (2: weights + gradients; 3 with SGD momentum).
    Layers run on copies in training mode, so the model (and BatchNorm statistics) is left untouched.
    """
    sizes, x = [], sample.detach()
    for layer in model:
        layer = copy.deepcopy(layer).train()
        params = list(layer.parameters())
        with SavedActivations(exclude=params) as meter:
            x = layer(x.detach().requires_grad_(x.is_floating_point()))
        sizes.append(int(param_scale * sum(p.numel() * p.element_size() for p in params) + meter.peak_bytes))
    return sizes


def layer_costs(method: str, model: nn.Sequential, micro_batch: torch.Tensor, device: torch.device,
                profile_seconds: float = 1.0) -> list[int]:
    """Per layer: microseconds of forward + backward (``time``), or bytes (``memory``), on ``micro_batch``.

    Times are summed over as many passes as fit in ``profile_seconds`` (at least one), after one warm-up
    pass that is not counted: first calls pay for memory allocation and kernel selection.
    """
    if method not in BALANCE_METHODS:
        raise ConfigError(f"--balance-by {method!r}: choose one of {', '.join(BALANCE_METHODS)}")
    model = without_hooks(model)  # profiling passes must not reach the real layers' hooks (K-FAC's capture)
    if method == "time":
        profile_times(model, micro_batch.to(device), 0.0, torch.device(device))
        return profile_times(model, micro_batch.to(device), profile_seconds, torch.device(device))
    if device.type == "cuda":
        return profile_sizes(model, micro_batch.to(device), 1, 2.0, device)
    return estimate_layer_memory(model, micro_batch.to(device))


def compute_balance(method: str, partitions: int, model: nn.Sequential, batch: torch.Tensor, chunks: int,
                    device: torch.device, profile_seconds: float = 1.0) -> list[int]:
    """Layers per partition, so the partitions' summed :func:`layer_costs` on one micro-batch are as equal as
    possible (torchgpipe's block partition, as ``balance_by_time`` / ``balance_by_size`` do)."""
    if partitions > len(model):
        raise ConfigError(f"{partitions} partitions but the model has only {len(model)} layers; use fewer partitions")
    # BatchNorm needs more than one value per channel in training mode, hence at least 2 samples.
    micro = batch[:max(2, math.ceil(len(batch) / chunks))]
    return balance_cost(layer_costs(method, model, micro, device, profile_seconds), partitions)

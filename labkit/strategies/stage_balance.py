"""How many layers of an ``nn.Sequential`` each stage gets: at given split points, or balancing parameters or
measured times (the cut :mod:`labkit.strategies.model_parallel` and the pipelines place, re-exported there).

    partition([3, 1, 1, 3], 2)      # [2, 2]: the cut that makes the largest stage's sum smallest
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import torch
from torch import nn
from torchgpipe.balance.profile import profile_times

from labkit.errors import ConfigError


def balance_from_split_points(num_layers: int, split_points: Sequence[int]) -> list[int]:
    """Layers per stage when cutting before each index in ``split_points``: (6, [2, 5]) -> [2, 3, 1]."""
    points = list(split_points)
    for p in points:
        if not 1 <= p <= num_layers - 1:
            raise ConfigError(f"split point {p} is out of range: a model with {num_layers} layers can be cut "
                              f"before layer 1 .. {num_layers - 1}")
    if points != sorted(set(points)):
        raise ConfigError(f"split points {points} must be strictly increasing, e.g. {sorted(set(points))}")
    bounds = [0, *points, num_layers]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _check_stages(num_layers: int, stages: int) -> None:
    if stages < 1:
        raise ConfigError(f"the number of devices must be >= 1, got {stages}")
    if stages > num_layers:
        raise ConfigError(f"cannot split a model of {num_layers} layers over {stages} devices: every device "
                          f"needs at least one layer; use at most {num_layers} devices")


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Cut ``costs`` (one per layer) into ``stages`` contiguous, non-empty runs so the largest run sum is as
    small as possible; returns the run lengths. Exact dynamic programme, O(stages · n²):

        best[j][i] = min_{c < i} max(best[j-1][c], cost[c:i])    (j stages over the first i layers)
    """
    n = len(costs)
    _check_stages(n, stages)
    prefix = [0.0, *itertools.accumulate(costs)]
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for i in range(j, n - stages + j + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, c
    bounds, i = [n], n
    for j in range(stages, 0, -1):
        i = cut[j][i]
        bounds.append(i)
    bounds.reverse()
    return [b - a for a, b in itertools.pairwise(bounds)]


def balance_by_params(model: nn.Sequential, stages: int) -> list[int]:
    """Layers per stage so the largest stage holds as few parameters as possible (contiguous stages)."""
    return partition([sum(p.numel() for p in layer.parameters()) for layer in model], stages)


def without_hooks(model: nn.Sequential) -> nn.Sequential:
    """A copy of ``model`` whose modules run no hooks, to profile: the real model's hooks (K-FAC's factor capture)
    would otherwise see every profiling pass, as many as fit in the time, on the profiling device."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                      module._backward_hooks):
            hooks.clear()
    return twin


def layer_times(model: nn.Sequential, sample: torch.Tensor, timeout_s: float = 1.0) -> list[int]:
    """Each layer's forward + backward time (microseconds, summed over the passes), measured by torchgpipe's
    profiler on hook-free copies of the layers (:func:`without_hooks`) on ``sample``'s device for about
    ``timeout_s`` seconds, after as long again uncounted: the first passes pay set-up (kernel selection, workspaces, fresh memory) that would otherwise
    land on the first layer (on a CPU, cold, the first convolution of alexnet_small measured 60-90 % of the step
    instead of ~5 %, and one warm-up pass was not enough)."""
    if any(p.grad is not None for p in model.parameters()):
        raise ConfigError("the layers are profiled from scratch: call model.zero_grad(set_to_none=True) first")
    twin = without_hooks(model)
    profile_times(twin, sample, timeout_s, sample.device)  # warm-up, not counted
    return profile_times(twin, sample, timeout_s, sample.device)


def balance_by_time(model: nn.Sequential, sample: torch.Tensor, stages: int, timeout_s: float = 1.0) -> list[int]:
    """Layers per stage balancing each layer's forward + backward time (:func:`layer_times`)."""
    _check_stages(len(model), stages)
    return partition(layer_times(model, sample, timeout_s), stages)

"""What the broken programs share: a small classification task, its model, and DDP's gradient step by hand.

Kept here so that each program shows only its own story. Everything is plain PyTorch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, CLASSES = 20, 10
#: the exit code of a rank a program loses on purpose (``replica-lost``): the runner counts it as the scenario
LOST = 43

#: the GPU index a program chose with :func:`use_gpu` (on a machine without GPUs it runs on the CPU)
chosen_gpu: int | None = None


def toy_data(n: int = 512, seed: int = 1234) -> TensorDataset:
    """``n`` samples of 20 features labelled by a fixed random linear teacher into 10 classes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(1))


def toy_model(width: int = 32, depth: int = 1) -> nn.Module:
    """``depth`` hidden layers of ``width`` units with ReLU, then a linear classifier."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(FEATURES if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def average_gradients(model: nn.Module) -> None:
    """What DDP does after ``backward()``: every gradient becomes its mean over the ranks."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def use_gpu(index: int) -> torch.device:
    """Select GPU ``index`` when there are GPUs; else remember the choice and compute on the CPU."""
    global chosen_gpu
    chosen_gpu = index
    if torch.cuda.is_available():
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")

"""Mixed precision (``--amp bf16``) and memory layout (``--channels-last``) for the training loop.

bfloat16 keeps float32's exponent range, so unlike float16 it needs no loss scaling: autocast runs matmuls and
convolutions in bf16 and keeps reductions (softmax, cross-entropy) and the weights in float32. It works on CPUs
(AVX-512/AMX make it fast) and on CUDA GPUs from Ampere on. Channels-last (NHWC) lets cuDNN and oneDNN pick
their fastest convolution kernels; it changes no result beyond floating-point reassociation.
"""
from __future__ import annotations

import contextlib

import torch

from labkit.errors import ConfigError

#: ``--amp`` choices
AMP_MODES = ("bf16",)


def check_amp(amp: str | None, strategy: str | type) -> None:
    """ConfigError for an unknown ``--amp`` mode or a strategy autocast cannot reach.

    ``strategy`` is a strategy class or its registered name; its ``supports_amp`` attribute says whether autocast
    reaches its forward passes (not where they run in worker threads, as torchgpipe's do on GPUs: a thread-local
    mode stays behind; refused on every device so that a command means the same on a laptop and a GPU node).
    """
    if amp is None:
        return
    if amp not in AMP_MODES:
        raise ConfigError(f"--amp {amp!r} is not supported; choose one of: {', '.join(AMP_MODES)}")
    if isinstance(strategy, str):
        from labkit.strategies import get_strategy

        strategy = get_strategy(strategy)
    if not strategy.supports_amp:
        raise ConfigError(f"--amp {amp} does not reach --strategy {strategy.name}: {strategy.amp_note}; "
                          "train it in float32")


def autocast(amp: str | None, device: torch.device):
    """A context that runs the forward pass under ``--amp`` on ``device``'s type (nothing if ``amp`` is None)."""
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` in NHWC memory order if it is a batch of images (B, C, H, W); other tensors unchanged."""
    return x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x

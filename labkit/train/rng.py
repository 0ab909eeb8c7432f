"""The GPU random-number states a mid-epoch checkpoint carries: this rank's devices' only.

A rank saves the state of each GPU it computes on (one, or a pipeline's partitions), by device index. On resume
each state goes back to the GPU of that index where this node sees one; a state for a GPU it does not see (fewer
GPUs visible, or a CPU node, whose run draws no CUDA random numbers) is left out, with one line saying so.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def cuda_rng_states(devices: Iterable[torch.device]) -> dict[int, torch.Tensor]:
    """``{device index: RNG state}`` of the CUDA devices among ``devices`` (empty on a CPU run)."""
    cuda = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    return {d.index or 0: torch.cuda.get_rng_state(d) for d in dict.fromkeys(cuda)}


def restore_cuda_rng(saved: dict[int, torch.Tensor] | list[torch.Tensor]) -> list[int]:
    """Put each saved state back on the GPU of its index, where visible; return the indices left out.

    ``saved`` may be the older format, every visible GPU's state in index order (a list).
    """
    if isinstance(saved, list):
        saved = dict(enumerate(saved))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index, state in saved.items():
        if index < visible:
            torch.cuda.set_rng_state(state, index)
    return sorted(index for index in saved if index >= visible)

"""Activation memory of a GPT per rank under context parallelism, measured: the bytes autograd saves.

    saved_tensor_bytes(lambda: loss_fn(model(x), y).backward, model.parameters())  # measured, forward only
    predict_memory(cfg.replace(block_size=32), 2, cp=2)["activations"]              # the formula (labkit.parallel.memory)

What autograd keeps from the forward for the backward is what grows with the sequence. Per token of a rank, in
float32 (4 bytes), a GPT block saves its two layer-norm inputs and outputs (4·C) and their mean and 1/std (4),
q, k, v (3·C), the attention output (C) and its log-sum-exp per head (H), the MLP's hidden layer before and after
GELU (8·C): ``16·C + H + 4`` values. The head saves ``ln_f``'s input, output and statistics and the log-softmax
over the vocabulary: ``2·C + 2 + V`` values. The token ids and the targets are int64 (8 bytes each per token),
the positions int64 per position, the loss one float (:func:`labkit.parallel.memory.predict_memory`'s
``activations``, the one memory model)::

    bytes = B·(T/cp)·(4·(L·(16·C + H + 4) + 2·C + 2 + V) + 16) + 8·T/cp + 4

Single-device attention on the CPU (``scaled_dot_product_attention``'s flash kernel) and ring attention save
the same tensors (q, k, v, the output and the log-sum-exp, never the T x T scores), so the formula holds at
cp = 1 as at cp = 2, 4: memory per rank falls as 1/cp. The K/V that travel the ring are not kept: the backward
passes them round again. Dropout (off here) would add its masks.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


def saved_tensor_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (a forward), ``exclude``'s (the
    parameters) left out: the activation memory the backward will need."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


"""Activation checkpointing (``labkit train --recompute none|full|selective``): what a block keeps for its backward,
and what it recomputes instead.

    model = get_model("gpt-tiny", 96, recompute="full")    # each transformer block recomputed in backward
    set_recompute(model, "selective")                      # only attention's softmax(q kᵀ) v part
    set_recompute(get_model("resnet20"), "full")           # each residual block

* ``full``: a block's forward runs without keeping its intermediate tensors; only its input is kept, and in backward
  the block's forward runs again (Chen et al. 2016) to rebuild them: the activations of every block but one
  replaced by their inputs, for nearly one forward more per step (the replay stops as soon as every tensor backward
  needs is rebuilt, so a block's last product, the MLP's output projection, is not run again; notebook 12 counts it).
* ``selective`` (a GPT only): only attention's core, ``softmax(q kᵀ/√d + mask)`` (its dropout) ``· v``, is
  recomputed (Korthikanti et al. 2022, §4: the part whose saved tensors grow as ``a·s²`` and whose FLOPs are few).
  Where the attention kernel is a fused one that never keeps the scores (scaled_dot_product_attention's flash
  kernels; ring attention under ``--mesh cp``), the saving is its per-row log-sum-exp, and with dropout the math
  kernel's ``s × s`` softmax, mask and dropped scores.

Both use ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which replays the forward with the random
state it had (``preserve_rng_state``): dropout masks, a tensor-parallel rank's forked stream
(:mod:`labkit.parallel.tp_rng` draws its seed from the default stream, restored before the replay) and autocast
are the same in the replay, so a recomputed run equals one that is not, loss and weights. A block's buffers
(batch-norm running statistics) are put back after the replay, so they are updated once per forward, not twice.
Collectives inside a block (tensor parallelism's, an expert layer's all-to-all, ZeRO-3's and FSDP's gathers)
run again in the replay, on every rank in the same order, as in Megatron-LM.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit.models.names import check_recompute


class _BuffersKept:
    """The replay's updates to ``module``'s buffers (batch-norm statistics) undone: the forward made them once.
    Re-entrant: a backward split in two (a pipeline's B and W passes) replays a block twice."""

    def __init__(self, module: nn.Module):
        self.module, self.saved = module, []

    def __enter__(self):
        self.saved = [(b, b.detach().clone()) for b in self.module.buffers()]

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, value in self.saved:
                b.copy_(value)


def recomputed(module: nn.Module, fn, *args):
    """``fn(*args)`` (a part of ``module``'s forward) with nothing kept for backward but ``args``: recomputed there."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), _BuffersKept(module)))


def _transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """A GPT's blocks (:class:`labkit.models.gpt.Block`: a ``recompute`` switch and an ``attn``), in any wrapping."""
    return [m for m in model.modules() if hasattr(m, "recompute") and hasattr(m, "attn")]


def _cnn_blocks(model: nn.Module) -> list[nn.Module]:
    """The residual blocks of a CNN (the kit's BasicBlock, torchvision's Bottleneck and BasicBlock)."""
    names = ("BasicBlock", "Bottleneck")
    return [m for m in model.modules() if type(m).__name__ in names]


def set_recompute(model: nn.Module, mode: str, name: str | None = None) -> nn.Module:
    """``model`` (a GPT or a CNN with residual blocks; ``name``: its ``--model``, for the refusal) with ``mode``
    (:data:`~labkit.models.names.RECOMPUTE`) set on each block, in place; returns it.

    Raises:
        ConfigError: an unknown mode, ``selective`` on a model without attention, ``full`` on one without blocks.
    """
    layers = _transformer_blocks(model)
    blocks = _cnn_blocks(model)
    check_recompute(name or type(model).__name__, mode, attention=bool(layers), blocks=bool(layers or blocks))
    for block in layers:
        block.recompute = mode == "full"
        block.attn.recompute_scores = mode == "selective"
    for block in blocks:
        block.__dict__.pop("forward", None)  # the class's forward again
        if mode == "full":
            block.forward = functools.partial(recomputed, block, block.forward)
    return model


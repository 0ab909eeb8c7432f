"""A GPT cut into pipeline stages by attribute name, and the tied embedding's two copies.

    stage = GPTStage(model, balance=[1, 1], index=0)   # tok_emb, pos_emb, drop, blocks.0
    stage = GPTStage(model, balance=[1, 1], index=1)   # blocks.1, ln_f, head

Stage 0 holds ``tok_emb``, ``pos_emb``, ``drop`` and its blocks; the last stage holds its blocks, ``ln_f`` and
``head``; a middle stage holds only blocks. The cut goes by the names :class:`labkit.models.gpt.GPT` gives its layers,
not by their types, so a GPT already sharded by the ``tp`` dimension (column/row-parallel linears,
vocabulary-parallel embedding) cuts the same way. The stage's parameter names are the whole model's
(``blocks.3.attn.q.weight`` stays ``blocks.3...``): checkpoints and comparisons line up name by name.

The tied head: one (V, C) matrix embeds on stage 0 and predicts on the last stage. Once cut, each of the two
stages holds its own copy (:data:`TIED` names it); the copies start equal and stay equal because their
gradients are summed over the embedding group every step (:class:`labkit.parallel.pp.PipelineParallel`), which
gives each copy the tied matrix's whole gradient: ∂L/∂W = ∂L/∂W|embedding + ∂L/∂W|head.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.errors import ConfigError

#: the tied matrix's name on the first stage (the embedding) and on the last (the head)
TIED = {"first": "tok_emb.weight", "last": "head.weight"}
_PARTS = ("tok_emb", "pos_emb", "drop", "blocks", "ln_f", "head")


def is_gpt(model: nn.Module) -> bool:
    """Does ``model`` have a GPT's layer names (:class:`labkit.models.gpt.GPT`, sharded or not)?"""
    return all(hasattr(model, part) for part in _PARTS)


def is_tied(model: nn.Module) -> bool:
    """Is the head's weight the embedding's (one parameter, two uses)?"""
    return model.head.weight is model.tok_emb.weight


class GPTStage(nn.Module):
    """Stage ``index`` of ``model`` cut into ``len(balance)`` stages, ``balance[i]`` blocks on stage ``i``.

    First stage: (B, T) token ids -> (B, T, C) activations; middle: (B, T, C) -> (B, T, C); last:
    (B, T, C) -> (B, T, V) logits (V / tp of them under tensor parallelism). The layers are ``model``'s own
    objects, not copies.
    """

    def __init__(self, model: nn.Module, balance: list[int], index: int):
        super().__init__()
        if not is_gpt(model):
            raise ConfigError(f"pp cuts a GPT by its layer names {', '.join(_PARTS)}; {type(model).__name__} has "
                              "not all of them")
        self.first, self.last = index == 0, index == len(balance) - 1
        start = sum(balance[:index])
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        # keyed by the block's index in the whole model, so parameter names stay the model's
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, start + balance[index])})
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)                 # x: (B, T) token ids; pos: (T,)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))              # (B, T, C)
        for block in self.blocks.values():
            x = block(x)                                                    # (B, T, C)
        if self.last:
            x = self.head(self.ln_f(x))                                     # (B, T, V)
        return x

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the tied (V, C) matrix: the embedding's on the first stage, the head's on the
        last, None on a middle stage."""
        if self.first:
            return self.tok_emb.weight
        return self.head.weight if self.last else None

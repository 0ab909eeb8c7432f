"""The GPT a mesh search prices: its shape (blocks, width, heads, vocabulary, sequence; experts for a mixture of
experts) and the parameter counts the mesh's formulas read (:mod:`labkit.advisor.mesh`).

    gpt_shape("gpt-moe-tiny").active_params      # the parameters one token passes
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTShape:
    """``L`` blocks of width ``C`` with ``a`` heads, vocabulary ``V``, sequence ``T``; a mixture of experts has
    ``n_expert`` MLPs per block, ``top_k`` of them per token (0: a dense GPT)."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    seq: int
    name: str = "GPT"
    n_expert: int = 0
    top_k: int = 0

    @property
    def mlp_params(self) -> int:
        """One MLP: ``C → 4C → C`` with biases, ``8C² + 5C``."""
        return 8 * self.n_embd ** 2 + 5 * self.n_embd

    @property
    def block_params(self) -> int:
        """Attention and two layer norms ``4C² + 8C``, then one MLP (``12C² + 13C`` in all) or a router ``C·E``
        and ``E`` MLPs."""
        C, E = self.n_embd, self.n_expert
        return 4 * C * C + 8 * C + (C * E + E * self.mlp_params if E else self.mlp_params)

    @property
    def expert_params(self) -> int:
        return self.n_layer * self.n_expert * self.mlp_params

    @property
    def params(self) -> int:
        return self.n_layer * self.block_params + (self.vocab_size + self.seq) * self.n_embd

    @property
    def active_params(self) -> int:
        """``P_a``: the parameters one token passes (a MoE's ``k`` experts of ``E``)."""
        return self.params - self.expert_params + self.n_layer * self.top_k * self.mlp_params

    def config(self, n_layer: int | None = None):
        from labkit.gpt import GPTConfig

        return GPTConfig(self.vocab_size, self.seq, n_layer or self.n_layer, self.n_head, self.n_embd)


#: GPT-3's 1.3B shape (Brown et al. 2020) at sequence 4096, GPT-2's vocabulary padded to 50304
GPT_1_3B = GPTShape(24, 16, 2048, 50304, 4096, "1.3B")


def gpt_shape(model: str, seq: int | None = None) -> GPTShape:
    """``--model``'s GPT (``gpt-1.3b``, one of :data:`labkit.gpt.GPT_SIZES` or :data:`labkit.moe.MOE_SIZES` by its
    ``LANGUAGE_MODELS`` name) with GPT-2's vocabulary (50304) at sequence ``seq`` (default its block size)."""
    from labkit.errors import ConfigError
    from labkit.gpt import GPT_SIZES
    from labkit.model_names import LANGUAGE_MODELS
    from labkit.moe import MOE_SIZES

    if model == "gpt-1.3b":
        return GPTShape(**{**GPT_1_3B.__dict__, "seq": seq or GPT_1_3B.seq})
    cfg, moe = MOE_SIZES.get(model, (GPT_SIZES.get(LANGUAGE_MODELS.get(model, "")), None))
    if cfg is None:
        raise ConfigError(f"the mesh search prices a dense GPT: gpt-1.3b or {', '.join(GPT_SIZES)}, or a mixture of "
                          f"experts: {', '.join(MOE_SIZES)}; not {model!r}")
    experts = (moe.n_expert, moe.top_k) if moe else (0, 0)
    return GPTShape(cfg.n_layer, cfg.n_head, cfg.n_embd, 50304, seq or cfg.block_size, model, *experts)

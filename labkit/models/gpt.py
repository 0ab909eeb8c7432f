"""A decoder-only transformer (GPT), written plainly so every parallel form of it can be read beside it.

    model = GPT(GPT_SIZES["gpt-tiny"].replace(vocab_size=96))      # (B, T) token ids -> (B, T, 96) logits
    count_parameters(model)                                          # 425,472 (gpt-tiny, vocab 96)

Token and learned position embeddings, ``n_layer`` pre-norm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``,
a final layer norm and a head tied to the token embedding (``head.weight is tok_emb.weight``). Dropout
(``GPTConfig.dropout``, 0 unless ``labkit train --dropout P``) after the embedding, on the attention weights and
on each residual branch.

The layer names are the ones the parallel forms address (:mod:`labkit.parallel`): ``attn.q``, ``attn.k``,
``attn.v`` (separate projections, so each can be split by heads on its own), ``attn.proj``, ``mlp.fc``,
``mlp.proj``. Attention infers its number of heads from the width of ``q``'s output, so a tensor-parallel rank
that holds ``n_head / tp`` heads runs the same code. ``forward(idx, pos)`` takes the positions explicitly when a
rank holds a slice of the sequence that does not start at 0 (context parallelism).

Sizes (:data:`GPT_SIZES`): ``gpt-tiny`` trains on a 2-core laptop in minutes; ``gpt-small`` is nanoGPT's
Shakespeare-character size; ``gpt-100m`` is GPT-2 small's shape (124 M parameters with GPT-2's 50,257-token
vocabulary, 85 M of them outside the embedding) for a GPU node.
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labkit.models.recompute import recomputed


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``block_size`` is the longest sequence (the position table's length)."""

    vocab_size: int = 96
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def replace(self, **changes) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


#: the named sizes ``--model`` accepts; vocab_size and block_size come from the dataset
GPT_SIZES: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128),
    "gpt-small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt-100m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: softmax(q kᵀ / √d_head + causal mask) v, then an output projection.

    The number of heads is ``q``'s output width ÷ ``head_dim``: all heads on one device, ``n_head / tp`` on a
    tensor-parallel rank.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        #: the random stream of the attention dropout: the default one here; a tensor-parallel rank's own for its
        #: heads (:mod:`labkit.parallel.tp_rng`), given a ``device -> context manager``
        self.dropout_stream = None
        #: ``--recompute selective``: keep q, k, v only and recompute :meth:`core` in backward
        self.recompute_scores = False

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ / √d_head + causal mask) (dropped out) v: (B, H, T, D) each -> (B, H, T, D)."""
        p = self.dropout if self.training else 0.0
        with self.dropout_stream(q.device) if p and self.dropout_stream else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape                                                    # (B, T, C)
        q, k, v = (layer(x).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, H, T, D)
                   for layer in (self.q, self.k, self.v))
        y = recomputed(self, self.core, q, k, v) if self.recompute_scores else self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)                               # (B, T, H*D)
        return self.proj(y)                                                   # (B, T, C)


class MLP(nn.Module):
    """Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))). With ``recompute``
    (``--recompute full``) it keeps only its input for backward and runs :meth:`body` again there."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.recompute = False

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))  # (B, T, C)
        return x + self.drop(self.mlp(self.ln2(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self, self.body, x) if self.recompute else self.body(x)


class GPT(nn.Module):
    """(B, T) token ids -> (B, T, vocab_size) next-token logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one (V, C) matrix embeds and predicts
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]                                                       # idx: (B, T)
        if pos is None:
            if T > self.cfg.block_size:
                raise ValueError(f"sequence of {T} tokens is longer than block_size {self.cfg.block_size}")
            pos = torch.arange(T, device=idx.device)                           # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))                   # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                         # (B, T, V)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``new_tokens`` sampled tokens to ``idx`` (B, T0), each conditioned on the last ``block_size``."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :] / max(temperature, 1e-6)  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def gpt(name: str, vocab_size: int, block_size: int | None = None, **changes) -> GPT:
    """The GPT of size ``name`` (:data:`GPT_SIZES`) for a vocabulary of ``vocab_size`` tokens and sequences of up to
    ``block_size`` (default: the size's own)."""
    cfg = GPT_SIZES[name].replace(vocab_size=vocab_size, **changes)
    if block_size is not None:
        cfg = cfg.replace(block_size=block_size)
    return GPT(cfg)

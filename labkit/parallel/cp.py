"""The ``cp`` dimension of a mesh: context parallelism, every sequence spread over the ``cp`` ranks.

    torchrun --nproc_per_node 2 -m labkit train --mesh cp=2 --model gpt-tiny --dataset text-sample
    ... --mesh dp=2,cp=2          # two batch shards, each sequence over two ranks

Each rank of a ``cp`` group reads the same samples and keeps its chunks of every sequence: with the zig-zag
layout (default) rank r of ``cp`` keeps chunks r and 2·cp-1-r of 2·cp (:mod:`labkit.collectives.kv_ring`), so
under the causal mask every rank has the same attention work. Everything but attention acts on one token at a
time and runs unchanged on the rank's tokens, given their positions (the GPT's ``forward(idx, pos)``: a forward
pre-hook passes them). Attention is swapped for ring attention over the ``cp`` group
(:mod:`labkit.parallel.ring_attention`), with the same ``q``, ``k``, ``v``, ``proj`` layers, so parameter names
and checkpoints stay the GPT's.

Loss and gradients: a rank's loss is the mean over its tokens, and every rank of the group holds the same number
of tokens, so the mean of the ranks' losses is the loss of the whole sequence and its gradient is the mean of
theirs: after backward the gradients are averaged over the ``cp`` group (one bucketed all-reduce, as dp).

Sequence lengths: the model's ``block_size`` (the training sequence length) must be a multiple of 2·cp (cp for
``--cp-layout contiguous``); anything else is refused before training, with the valid lengths named. Nothing is
padded.

Evaluation (``model.eval()``): the model takes whole sequences, keeps its rank's chunks itself, and
:meth:`ContextParallel.full_output` gathers the logits of the whole sequence (an all-gather, never in a
training step).
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.collectives.kv_ring import KVRing, kv_ring
from labkit.dist.group import all_gather
from labkit.errors import ConfigError
from labkit.parallel.base import Dimension, refuse_moe
from labkit.parallel.data_parallel import DEFAULT_BUCKET_MB, average_gradients
from labkit.parallel.ring_attention import positions, ring_attention, shard, unshard

#: ``labkit train --mesh ...cp=N...`` flags of this dimension, plain data read without importing it (labkit.flags)
FLAGS = [
    {"flag": "--cp-layout", "default": "zigzag", "choices": ["zigzag", "contiguous"],
     "help": "cp dimension: how a sequence is cut over the cp ranks: zigzag = chunks r and 2cp-1-r of 2cp (every "
             "rank the same causal work), contiguous = chunk r of cp (the last rank does the most)"},
]
#: ``labkit advise --model gpt-*``'s mesh search (labkit.parallel.pricing): the pricing function below
ADVISOR = {"price": "labkit.parallel.cp:mesh_time"}


class RingSelfAttention(nn.Module):
    """The GPT's causal self-attention with ring attention over ``group``: the same ``q``, ``k``, ``v``,
    ``proj`` layers (so the same parameters and names); the rank's tokens in, the rank's tokens out."""

    def __init__(self, attn: nn.Module, ring: KVRing, group):
        super().__init__()
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.head_dim = attn.head_dim
        self.ring, self.group = ring, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape                                                    # (B, T / cp, C)
        q, k, v = (layer(x).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, H, T / cp, D)
                   for layer in (self.q, self.k, self.v))
        y = ring_attention(q, k, v, self.ring, self.group)                   # (B, H, T / cp, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))               # (B, T / cp, C)


class ContextParallel(Dimension):
    """Sequences split over the ``cp`` ranks, attention as a ring over them, gradients averaged."""

    name = "cp"

    def __init__(self, mesh, options):
        super().__init__(mesh, options)
        self.ring = kv_ring(self.size, causal=True, layout=self.options.get("cp_layout") or "zigzag")
        self.bucket_bytes = int(DEFAULT_BUCKET_MB * 2**20)
        self.averages_gradients = self.size > 1

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        refuse_moe("cp", self.size, model_name, "the router balances and caps its experts over a whole sequence, "
                   "and a cp rank holds only its chunks of it")
        if self.size > 1 and not model_name.startswith("gpt"):
            raise ConfigError(f"--mesh cp={self.size} splits the sequences of a transformer; it needs --model gpt-tiny, "
                              f"gpt-small or gpt-100m, not --model {model_name}")
        pp = self.mesh.size(self.mesh.mesh_dim_names.index("pp"))
        if self.size > 1 and pp > 1:  # the stages would lose the positions the GPT's pre-hook passes
            raise ConfigError(f"--mesh cp={self.size} with pp={pp} is not supported: the pipeline's stages do not get "
                              "the sequence positions of a rank's chunks; combine cp with dp and tp")
        if self.size > 1:
            self._refuse_dropout(dropout)
        if self.size > 1 and seq_len:  # the GPT's block size: refused before the data and the model
            self.ring.check_length(seq_len)

    def _refuse_dropout(self, dropout: float) -> None:
        if dropout:
            raise ConfigError(f"--mesh cp={self.size}: ring attention has no attention dropout; train with dropout 0 "
                              f"(--dropout {dropout:g})")

    def parallelize(self, model: nn.Module) -> nn.Module:
        if self.size == 1:
            return model
        cfg = model.cfg
        self._refuse_dropout(cfg.dropout)  # a model built elsewhere than labkit train (check saw the flags)
        self.ring.check_length(cfg.block_size)  # ConfigError naming the valid lengths, before any step
        for block in model.blocks:
            block.attn = RingSelfAttention(block.attn, self.ring, self.group)
        model.register_forward_pre_hook(self._positions, with_kwargs=True)
        return model

    def _positions(self, model: nn.Module, args: tuple, kwargs: dict):
        # training: idx holds this rank's chunks (shard_batch); evaluation: whole sequences, sharded here
        idx = args[0] if args else kwargs.pop("idx")
        if not model.training:
            idx = shard(idx, self.ring, self.rank, 1)
        chunk = idx.shape[1] // len(self.ring.chunks_of(self.rank))
        return (idx,), {**kwargs, "pos": positions(self.ring, self.rank, chunk, idx.device)}

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.size == 1:
            return x, y
        self.ring.check_length(x.shape[1])
        return shard(x, self.ring, self.rank, 1), shard(y, self.ring, self.rank, 1)  # (B, T / cp) each

    def sync_gradients(self, model: nn.Module) -> None:
        if self.size > 1:
            average_gradients(model.parameters(), "native", self.bucket_bytes, group=self.group)

    def full_output(self, out: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return out
        parts = all_gather([torch.empty_like(out) for _ in range(self.size)], out.contiguous(), group=self.group)
        return unshard(parts, self.ring, 1)                                  # (B, T, V)

    @staticmethod
    def price(cfg, batch: int, seq: int, cp: int, bytes_per_element: int = 4) -> dict:
        """Bytes this rank hands to each kind of communication per step of a GPT of shape ``cfg``: the K/V ring of
        every layer, forward and backward (``p2p``: L x (6cp - 4) x batch x seq/cp x C x bytes, see
        :meth:`KVRing.bytes_sent`), and its gradients to the all-reduce over the cp group."""
        if cp == 1:
            return {"p2p": 0, "all_reduce": 0}
        C, extra = cfg.n_embd, 11 * cfg.n_embd if cfg.bias else 0  # biases of 6 linears and 2 layer norms
        params = (cfg.vocab_size + cfg.block_size) * C + cfg.n_layer * (12 * C * C + 2 * C + extra) + C + extra // 11
        ring = kv_ring(cp).bytes_sent(batch, seq, cfg.n_embd, bytes_per_element)
        return {"p2p": cfg.n_layer * ring, "all_reduce": bytes_per_element * params}


def mesh_time(step) -> float:
    """A mesh step's ``cp`` term (:class:`labkit.parallel.pricing.MeshStep`), ``c`` ranks of stride ``t``:

    ``cp = m·(r·β + 4·(c − 1)·L_s·α)``: per micro-batch the K/V ring's bytes ``r`` of the stage's ``L_s`` blocks
    (:meth:`ContextParallel.price`), ``c − 1`` messages per layer each way, forward and backward."""
    c = step.plan.cp
    if c == 1:
        return 0.0
    link = step.link(c, step.plan.tp)
    r = ContextParallel.price(step.stage, step.b, step.gpt.seq, c, step.e)["p2p"]
    return step.plan.microbatches * (r * link.beta + 4 * (c - 1) * step.layers * link.alpha)

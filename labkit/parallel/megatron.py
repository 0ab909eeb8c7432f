"""Megatron tensor parallelism (+ sequence parallelism) of :class:`labkit.models.gpt.GPT`, written out by hand.

    model = parallelize_gpt(GPT(cfg), group, sequence_parallel=True)   # in place; the same weights, sharded
    loss = VocabParallelCrossEntropy(group)(model(idx), targets)       # (B, T, V/t) logits shard -> mean loss
    loss.backward(); sync_sequence_parallel_grads(model, group)        # SP only: layer norms saw T/t tokens

The linear layers split column-parallel and row-parallel (:mod:`.layers`; a column layer feeds a row layer with
no communication between them). In a block, attention is split by heads
(q, k, v column-parallel: ``n_head/t`` heads per rank; ``proj`` row-parallel) and the MLP ``fc`` column → ``proj``
row, so a block costs the operator ``f`` before each pair and ``g`` after it (:mod:`.mappings`): one
all-reduce forward and one backward per pair. The embedding is split by vocabulary rows (ids outside a rank's
rows are masked, the partial embeddings all-reduced), the tied head is a column-parallel projection onto the
same rows, and :class:`VocabParallelCrossEntropy` reduces the max, the sum of exponentials and the target logit
over the group instead of gathering the (B, T, V) logits.

Sequence parallelism (Korthikanti et al. 2022): between the pairs the activations (B, T, C) are identical on
every rank; cut them along the sequence instead, (B, T/t, C), so the layer norms and dropout run on T/t tokens.
``f`` becomes an all-gather of the sequence (forward) / reduce-scatter (backward) and ``g`` a reduce-scatter /
all-gather. The parameters used on a sequence shard (layer norms, the row layers' biases, the position table)
get only their shard's gradient: :func:`sync_sequence_parallel_grads` sums them over the group, in one
all-reduce. The modules keep the names of :class:`labkit.models.gpt.GPT`'s (``blocks.0.attn.q.weight`` ...), so a
checkpoint's keys and an optimiser's parameter order match the single-process model's.

Dropout (``GPTConfig.dropout`` > 0): a mask on a rank's own heads or sequence slice comes from the rank's own
stream, a mask on the replicated (B, T, C) from the stream shared by the group (:mod:`.tp_rng`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from labkit.errors import ConfigError
from labkit.models.gpt import GPT
from labkit.parallel.layers import (
    ColumnParallelLinear,
    EnterTensorParallel,
    RowParallelLinear,
    mark_sequence_parallel,
    shard_rows,
)
from labkit.parallel.mappings import (
    all_reduce_copy,
    group_size,
    reduce_from_tp,
    scatter_sequence,
    sequence_shard,
    split_range,
)
from labkit.parallel.tp_rng import ShardDropout, TensorParallelRNG


class ParallelInputLayerNorm(nn.LayerNorm):
    """A layer norm whose output enters the tensor-parallel region (:class:`EnterTensorParallel`): one ``f`` for
    q, k and v together (one all-reduce backward, not three). Same parameters as the layer norm it replaces; with
    sequence parallelism it normalises (B, T/t, C) and its parameters are marked for the gradient sum."""

    def __init__(self, ln: nn.LayerNorm, group, sequence_parallel: bool = False):
        super().__init__(ln.normalized_shape, eps=ln.eps, elementwise_affine=ln.elementwise_affine,
                         bias=ln.bias is not None)
        self.weight, self.bias = ln.weight, ln.bias
        for p in self.parameters() if sequence_parallel else ():
            mark_sequence_parallel(p)
        self.enter = EnterTensorParallel(group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enter(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rank r's rows ``[start, stop)`` of the (V, C) token table (``r·V/t`` to ``(r+1)·V/t`` when ``t`` divides
    V; else the parts differ by one row). An id outside them looks up a zero row; the sum over ranks (``g``, or
    a reduce-scatter along the sequence with SP) is the full embedding."""

    def __init__(self, emb: nn.Embedding, group, sequence_parallel: bool = False):
        self.start, stop = split_range(emb.num_embeddings, group)
        super().__init__(stop - self.start, emb.embedding_dim)
        self.weight = nn.Parameter(shard_rows(emb.weight, group))                             # (V/t, C)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start                                                         # (B, T)
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)                      # (B, T, C)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_sequence(x, self.group) if self.sequence_parallel else reduce_from_tp(x, self.group)


class SequenceShardEmbedding(nn.Embedding):
    """Sequence parallelism's position table: the (T, C) embedding of the positions, this rank's (T/t, C) part
    (the part its token embeddings hold). Its gradient covers its positions only: marked for the group sum."""

    def __init__(self, emb: nn.Embedding, group):
        super().__init__(emb.num_embeddings, emb.embedding_dim)
        self.weight = mark_sequence_parallel(emb.weight)
        self.group = group

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        t = group_size(self.group)
        if pos.shape[-1] % t:
            raise ConfigError(f"sequence parallelism over {t} ranks needs the sequence length ({pos.shape[-1]}) "
                              f"to divide by {t}")
        return sequence_shard(super().forward(pos), self.group, dim=0)                  # (T/t, C)


def parallelize_gpt(model: GPT, group, sequence_parallel: bool = False) -> GPT:
    """Shard ``model`` (a :class:`labkit.models.gpt.GPT`) over the ranks of ``group``, in place; returns it.

    Every rank must hold the same full model (the same seed) before: each keeps its shard of those weights, so
    the sharded model computes what the full one does. Its output is this rank's (B, T, V/t) slice of the logits,
    for :class:`VocabParallelCrossEntropy`.

    Raises:
        ConfigError: ``t`` does not divide the heads or (with SP) the block size. (The vocabulary need not
            divide: its rows are split as evenly as they go.)
    """
    t, cfg = group_size(group), model.cfg
    for what, n in [("attention heads", cfg.n_head)] + \
            [("block size (sequence parallelism)", cfg.block_size)] * sequence_parallel:
        if n % t:
            raise ConfigError(f"--mesh tp={t} does not divide the {what} ({n}); choose a tp that does")
    sp = sequence_parallel
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, group, sp)
    if sp:
        model.pos_emb = SequenceShardEmbedding(model.pos_emb, group)
    for block in model.blocks:
        block.ln1 = ParallelInputLayerNorm(block.ln1, group, sp)
        for name in ("q", "k", "v"):                                                     # n_head/t heads
            setattr(block.attn, name, ColumnParallelLinear(getattr(block.attn, name), group))
        block.attn.proj = RowParallelLinear(block.attn.proj, group, sp)
        block.ln2 = ParallelInputLayerNorm(block.ln2, group, sp)
        block.mlp.fc = ColumnParallelLinear(block.mlp.fc, group)
        block.mlp.proj = RowParallelLinear(block.mlp.proj, group, sp)
    model.ln_f = ParallelInputLayerNorm(model.ln_f, group, sp)
    if cfg.dropout and t > 1:
        _shard_dropouts(model, TensorParallelRNG(group), sp)
    head = ColumnParallelLinear(model.head, group)                                       # (B, T, V/t) logits
    head.weight = model.tok_emb.weight                                                   # still tied
    model.head = head
    model.tp_group, model.sequence_parallel = group, sp
    return model


def _shard_dropouts(model: GPT, rng: TensorParallelRNG, sequence_parallel: bool) -> None:
    """The dropouts on sharded activations draw from this rank's stream (:mod:`.tp_rng`): attention, on its
    heads; with SP the embedding and residual dropouts, on its slice of the sequence. The others (without SP,
    on the replicated (B, T, C)) keep the default stream, the same on every rank of the group."""
    if sequence_parallel:
        model.drop = ShardDropout(model.drop.p, rng)
    for block in model.blocks:
        block.attn.dropout_stream = rng.fork
        if sequence_parallel:
            block.drop = ShardDropout(block.drop.p, rng)


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters used on sequence shards (marked by :func:`parallelize_gpt` with SP), in model order."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def sync_sequence_parallel_grads(model: nn.Module, group) -> None:
    """Sum the gradients of :func:`sequence_parallel_params` over ``group``: one all-reduce of them all
    flattened (each rank's layer norms saw only its T/t tokens). No-op without SP or on one rank.

    Under FSDP2 over dp (``--dp-shard fsdp``) a gradient is a DTensor holding this rank's dp shard, already
    reduce-scattered over dp: its local shard is summed (the ranks of one tp group share their dp coordinate, so
    they hold the same shard, and a sum over tp commutes with the average over dp)."""
    grads = [_local(p.grad) for p in sequence_parallel_params(model) if p.grad is not None]
    if not grads or group_size(group) == 1:
        return
    flat = all_reduce_copy(torch.cat([g.reshape(-1) for g in grads]), group)
    with torch.no_grad():
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's tensor on this rank: a DTensor's local shard (the same storage), a plain tensor itself."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary: ``loss_i = log Σ_v exp(z_iv) − z_i,y_i`` with
    ``Σ_v = Σ_r Σ_{v in r}``. Forward: all-reduce MAX of the row maxima m_i, then one SUM all-reduce of
    [Σ_{v in r} exp(z_iv − m_i), the target logit if y_i is among r's rows else 0]. Backward, no communication:
    ``dz_iv = (softmax_iv − [v = y_i]) / N`` on r's columns."""

    @staticmethod
    def forward(ctx, logits, targets, group, start):
        V_local = logits.shape[-1]
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))                  # (B, T, V/t)
        m = z.max(dim=-1).values                                                         # (B, T)
        if group_size(group) > 1:
            m = all_reduce_copy(m, group, op=dist.ReduceOp.MAX)
        e = torch.exp(z - m.unsqueeze(-1))                                               # (B, T, V/t)
        local = targets - start
        inside = (local >= 0) & (local < V_local)
        target_z = torch.gather(z, -1, local.clamp(0, V_local - 1).unsqueeze(-1)).squeeze(-1) * inside
        sums = torch.stack([e.sum(-1), target_z])                                        # (2, B, T)
        if group_size(group) > 1:
            sums = all_reduce_copy(sums, group)
        loss = (torch.log(sums[0]) + m - sums[1]).mean()
        ctx.save_for_backward(e.div_(sums[0].unsqueeze(-1)), local, inside)              # softmax shard
        ctx.dtype = logits.dtype
        return loss                          # bf16/fp16 promoted to float32, float64 kept: as F.cross_entropy

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        d = softmax.clone()
        d.scatter_add_(-1, local.clamp(0, softmax.shape[-1] - 1).unsqueeze(-1),
                       -inside.unsqueeze(-1).to(d.dtype))
        return d.mul_(grad / local.numel()).to(ctx.dtype), None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """``(logits_shard (B, T, V/t), targets (B, T)) -> mean loss`` over all B·T tokens, the same on every rank
    of ``group``, without gathering the (B, T, V) logits (see :class:`_VocabParallelCE`).

    ``vocab_size``: the whole vocabulary, where ``t`` does not divide it (the parts of
    :func:`~.mappings.split_range`); ``None``: ``t`` times the shard's width."""

    def __init__(self, group, vocab_size: int | None = None):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        V = self.vocab_size or logits.shape[-1] * group_size(self.group)
        start, stop = split_range(V, self.group)
        if stop - start != logits.shape[-1]:
            raise ValueError(f"logits hold {logits.shape[-1]} of the vocabulary's {V} tokens on this rank but its "
                             f"part is {stop - start}: give VocabParallelCrossEntropy the vocab_size")
        return _VocabParallelCE.apply(logits, targets, self.group, start)

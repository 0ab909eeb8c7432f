"""Ring attention: exact softmax attention over a sequence that is spread over the ranks of a process group.

    ring = kv_ring(cp, causal=True, layout="zigzag")
    out = ring_attention(q, k, v, ring, group)   # q, k, v, out: this rank's chunks, (B, H, T / cp, D)

Each rank holds the queries, keys and values of its own chunks of the sequence (:class:`KVRing` says which).
It attends to its own K/V first, then passes the K/V it holds to the next rank and receives the previous rank's,
p - 1 times, so every query meets every key. Each block of scores gives a partial result: the block's
attention output ``o_b`` (softmax over the block's keys only) and its log-sum-exp ``l_b = log Σ_j exp(s_j)``.
Two partial results over disjoint key sets merge exactly (the online softmax), in this order::

    m   = max(l_1, l_2)
    l   = m + log(exp(l_1 - m) + exp(l_2 - m))          # log-sum-exp over both key sets
    out = exp(l_1 - l) * o_1 + exp(l_2 - l) * o_2       # each part weighted by its share of the softmax mass

The backward needs only the final ``out`` and ``l``: with ``D = rowsum(dout * out)`` a block's probabilities
are ``P = exp(s - l)``, and ``dv = Pᵀ dout``, ``ds = P * (dout vᵀ - D)``, ``dq = ds k * scale``,
``dk = dsᵀ q * scale``. The K/V go round the ring again, carrying the dK/dV summed so far; one last step
brings every dK/dV to the rank that owns it.

The block kernel is plain PyTorch (``q kᵀ``, mask, ``logsumexp``), so it runs on any device and can be read
next to the formulas. Under bf16 autocast (``--amp bf16``) the blocks, the merges and the messages are
float32. In the forward, while a block is computed, the next K/V are already on their way
(:func:`labkit.collectives.kv_ring.pass_on` posts the send and the receive before the compute); the backward
sends after each block's gradients are added.

On entry the shapes are checked (:func:`check_shapes`): q, k and v alike, the local length a whole number of
this rank's chunks, and, the first time a group meets a shape, the same shape on every rank of the ring (one
all-gather of four numbers, then remembered: a training step adds no collective). A mismatch is a ``ValueError``
on every rank, naming both lengths, where it would otherwise end in a transport error on one rank and a wrong
result on another.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.collectives.kv_ring import Block, KVRing, pass_on
from labkit.dist.group import all_gather


@dataclass
class RingStats:
    """What a rank did, counted as it ran: score entries computed (per batch row and head), bytes sent."""

    score_entries: int = 0
    bytes_sent: int = 0


def positions(ring: KVRing, rank: int, chunk_len: int, device=None) -> torch.Tensor:
    """Sequence positions of the tokens ``rank`` holds, in the order they sit in its tensors."""
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in ring.chunks_of(rank)])


def shard(x: torch.Tensor, ring: KVRing, rank: int, dim: int) -> torch.Tensor:
    """``rank``'s chunks of the full-sequence tensor ``x`` along ``dim``, concatenated (a copy)."""
    chunks = x.chunk(ring.num_chunks, dim)
    return torch.cat([chunks[c] for c in ring.chunks_of(rank)], dim)


def unshard(parts: list[torch.Tensor], ring: KVRing, dim: int) -> torch.Tensor:
    """The full-sequence tensor from every rank's :func:`shard`, in rank order (the inverse)."""
    per = {}
    for rank, part in enumerate(parts):
        for c, piece in zip(ring.chunks_of(rank), part.chunk(len(ring.chunks_of(rank)), dim)):
            per[c] = piece
    return torch.cat([per[c] for c in range(ring.num_chunks)], dim)


def attend(q, k, v, scale: float, mask=None):
    """One block: ``(out, lse)`` of softmax(q kᵀ * scale) v over these keys; ``mask`` True = hidden."""
    s = (q @ k.transpose(-2, -1)) * scale                  # (B, H, Tq, Tk)
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                       # (B, H, Tq)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse       # (B, H, Tq, D), (B, H, Tq)


def merge(out, lse, block_out, block_lse):
    """Two partial results over disjoint keys -> one (the formula of the module docstring, in its order)."""
    m = torch.maximum(lse, block_lse)
    new_lse = m + torch.log(torch.exp(lse - m) + torch.exp(block_lse - m))
    new_out = torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return new_out, new_lse


def attend_backward(q, k, v, dout, lse, delta, scale: float, mask=None):
    """Gradients of one block given the final ``lse`` and ``delta = rowsum(dout * out)``: ``(dq, dk, dv)``."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))                   # this block's share of the final softmax
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


_AGREED: set[tuple] = set()  # (group, shape) pairs every rank of the group has been seen to share


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: KVRing, group, rank: int) -> None:
    """Raise ``ValueError`` on every rank unless q, k, v are alike, (B, H, T_local, D), ``T_local`` is a whole number
    of this rank's chunks and every rank of ``group`` holds the same shape (compared once per group and shape)."""
    alike = q.shape == k.shape == v.shape and q.dim() == 4
    key = (id(group), tuple(q.shape), alike)
    if key not in _AGREED:  # every rank gathers, even one whose own shapes are wrong: all raise, none waits
        mine = torch.tensor([*(tuple(q.shape) + (-1,) * 4)[:4], int(alike)], dtype=torch.int64, device=q.device)
        shapes = all_gather([torch.empty_like(mine) for _ in range(ring.world_size)], mine, group=group)
        if not all(int(s[4]) for s in shapes):
            bad = [r for r, s in enumerate(shapes) if not int(s[4])]
            raise ValueError(f"ring_attention takes q, k, v of one shape (B, H, T_local, D); rank(s) {bad} did not "
                             f"(here: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})")
        if any(not torch.equal(s, mine) for s in shapes):
            held = ", ".join(f"rank {r} {tuple(s[:4].tolist())}" for r, s in enumerate(shapes))
            raise ValueError(f"ring_attention: the ranks hold different shapes (B, H, T_local, D): {held}; every "
                             f"rank of the ring holds the same number of tokens, T / {ring.world_size}")
        chunks, length = len(ring.chunks_of(rank)), q.shape[2]
        if length % chunks:
            raise ValueError(f"ring_attention: a local length of {length} does not split into the {chunks} "
                             f"chunks each rank holds ({ring.layout}); give each rank a multiple of {chunks} tokens")
        _AGREED.add(key)


def _local(ring: KVRing, rank: int, chunks: tuple[int, ...], chunk_len: int) -> slice:
    # where a block's chunks sit in the tensors of the rank that holds them (always neighbours)
    idx = [ring.chunks_of(rank).index(c) for c in chunks]
    return slice(min(idx) * chunk_len, (max(idx) + 1) * chunk_len)


def _mask(ring: KVRing, block: Block, rank: int, owner: int, chunk_len: int, device):
    if not block.masked:
        return None
    qpos = positions(ring, rank, chunk_len, device)[_local(ring, rank, block.q, chunk_len)]
    kpos = positions(ring, owner, chunk_len, device)[_local(ring, owner, block.kv, chunk_len)]
    return kpos.unsqueeze(0) > qpos.unsqueeze(1)           # (Tq, Tk): a key in the query's future


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float32 for bf16/fp16 (and fp32), float64 stays


class RingAttention(torch.autograd.Function):
    """The autograd function behind :func:`ring_attention` (forward and backward each run their ring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: KVRing, group, scale: float, stats: RingStats | None):
        ctx.dtype = q.dtype
        with torch.autocast(q.device.type, enabled=False):  # bf16 autocast: blocks and merges in float32
            q, k, v = (t.to(_compute_dtype(q.dtype)) for t in (q, k, v))
            out = RingAttention._forward(ctx, q, k, v, ring, group, scale, stats)
        return out.to(ctx.dtype)

    @staticmethod
    def _forward(ctx, q, k, v, ring: KVRing, group, scale: float, stats: RingStats | None):
        rank, p = dist.get_rank(group), ring.world_size
        c = q.shape[-2] // len(ring.chunks_of(rank))
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()                 # one message per step
        for step in range(p):
            if step < p - 1:                                   # the next K/V travel while this block computes
                incoming = torch.empty_like(kv)
                requests = pass_on(kv, incoming, ring.forward_steps[step], rank, group)
                if stats is not None:
                    stats.bytes_sent += kv.numel() * kv.element_size()
            owner = ring.owner_at(rank, step)
            for block in ring.blocks(rank, step):
                rows, cols = _local(ring, rank, block.q, c), _local(ring, owner, block.kv, c)
                mask = _mask(ring, block, rank, owner, c, q.device)
                b_out, b_lse = attend(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], scale, mask)
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], b_out, b_lse)
                if stats is not None:
                    stats.score_entries += block.score_entries(c)
            if step < p - 1:
                for request in requests:
                    request.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.group, ctx.scale, ctx.stats = ring, group, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            grads = RingAttention._backward(ctx, dout.to(_compute_dtype(dout.dtype)))
        return (*(g.to(ctx.dtype) for g in grads), None, None, None, None)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, group, scale, stats = ctx.ring, ctx.group, ctx.scale, ctx.stats
        rank, p = dist.get_rank(group), ring.world_size
        c = q.shape[-2] // len(ring.chunks_of(rank))
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)                           # (B, H, T_local)
        dq = torch.zeros_like(q)
        held = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # K, V, dK, dV of the owner
        for step in range(p):
            owner = ring.owner_at(rank, step)
            for block in ring.blocks(rank, step):
                rows, cols = _local(ring, rank, block.q, c), _local(ring, owner, block.kv, c)
                mask = _mask(ring, block, rank, owner, c, q.device)
                bdq, bdk, bdv = attend_backward(q[..., rows, :], held[0][..., cols, :], held[1][..., cols, :],
                                                dout[..., rows, :], lse[..., rows], delta[..., rows], scale, mask)
                dq[..., rows, :] += bdq
                held[2][..., cols, :] += bdk
                held[3][..., cols, :] += bdv
            send = held if step < p - 1 else held[2:].contiguous()  # the last step takes only dK/dV home
            if p == 1:
                held = send
                continue
            incoming = torch.empty_like(send)
            for request in pass_on(send, incoming, ring.backward_steps[step], rank, group):
                request.wait()
            if stats is not None:
                stats.bytes_sent += send.numel() * send.element_size()
            held = incoming
        return dq, held[0], held[1]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: KVRing, group=None,
                   scale: float | None = None, stats: RingStats | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys; all of shape (B, H, T_local, D).

    ``ring.world_size`` must be ``group``'s size; ``stats`` (optional) counts what this rank computes and sends.
    """
    if ring.world_size != dist.get_world_size(group):
        raise ValueError(f"the ring has {ring.world_size} ranks, the group {dist.get_world_size(group)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if ring.world_size > 1:
        check_shapes(q, k, v, ring, group, dist.get_rank(group))
    if ring.world_size == 1:  # one rank: the plain kernel (same math, no ring)
        return RingAttention.apply(q, k, v, ring, group, scale, stats) if stats is not None else \
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=ring.causal, scale=scale)
    return RingAttention.apply(q, k, v, ring, group, scale, stats)

"""The key/value ring of context parallelism as plain data: who holds which chunks, which attention blocks each
rank computes at each step, and who sends whose keys and values to whom.

    ring = kv_ring(4, causal=True, layout="zigzag")
    ring.chunks_of(1)            # (1, 6): rank 1 holds chunks 1 and 2*4-1-1 of every sequence
    ring.blocks(1, 2)            # what rank 1 computes at step 2 (with the K/V of rank 3)
    ring.forward_steps[0]        # step 1: every rank r sends the K/V it holds to rank r+1
    ring.work(16)                # score entries per rank (per batch row and head) for T = 16: [40, 40, 40, 40]
    ring.bytes_sent(batch=2, seq_len=16, width=32, itemsize=4)   # bytes one rank sends per layer, fwd + bwd

It is notebook 01's ring applied to keys and values: a sequence of length T is cut into chunks, each rank keeps
the queries of its own chunks, and the keys/values (K/V) of every rank travel once around the ring (p - 1 steps)
so each rank meets all of them. The backward sends the K/V round again, together with the gradients dK/dV that
accumulate on the way, and one last step brings each dK/dV home to the rank that owns that K/V.

Layouts (``num_chunks`` chunks of T / num_chunks tokens each):

* ``"contiguous"``: p chunks, rank r holds chunk r. With a causal mask rank r needs only the K/V of ranks 0..r,
  so rank 0 computes 1 block and rank p-1 computes p: the last rank sets the pace.
* ``"zigzag"`` (head-tail): 2p chunks, rank r holds chunks r and 2p-1-r, one early and one late, so every rank
  has the same number of unmasked blocks.

The executor (:mod:`labkit.parallel.ring_attention`), the animation (:mod:`labkit.viz.kv_ring`) and the byte and
work counts below all read this one object.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from labkit.dist.group import comm_device
from labkit.errors import ConfigError

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class KVTransfer:
    """``src`` sends the K/V (and, in the backward, the dK/dV) of rank ``owner`` to ``dst``."""

    src: int
    dst: int
    owner: int
    tensors: tuple[str, ...] = ("k", "v")

    def describe(self) -> str:
        """``"rank 0 sends k, v of rank 3 to rank 1"``."""
        return f"rank {self.src} sends {', '.join(self.tensors)} of rank {self.owner} to rank {self.dst}"


@dataclass(frozen=True)
class Block:
    """One attention block: queries of chunks ``q`` against keys/values of chunks ``kv`` (global chunk numbers).

    ``masked``: some of its scores are in the future and get the causal mask (only the rank's own chunks)."""

    q: tuple[int, ...]
    kv: tuple[int, ...]
    masked: bool

    def score_entries(self, chunk_len: int) -> int:
        """Entries of ``q kᵀ`` this block computes, per batch row and head."""
        return len(self.q) * chunk_len * len(self.kv) * chunk_len


@dataclass(frozen=True)
class KVRing:
    """The ring of ``world_size`` ranks for one attention call; see the module docstring."""

    world_size: int
    causal: bool
    layout: str

    @property
    def num_chunks(self) -> int:
        return 2 * self.world_size if self.layout == "zigzag" else self.world_size

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks of every sequence that ``rank`` holds, in the order they sit in its tensors."""
        p = self.world_size
        return (rank, 2 * p - 1 - rank) if self.layout == "zigzag" else (rank,)

    def owner_at(self, rank: int, step: int) -> int:
        """Whose K/V ``rank`` holds at compute step ``step`` (0 = its own; one hop further each step)."""
        return (rank - step) % self.world_size

    def blocks(self, rank: int, step: int) -> list[Block]:
        """What ``rank`` computes at compute step ``step`` (0..p-1): its queries against the K/V it holds then,
        fully masked (future) pairs of chunks left out."""
        owner = self.owner_at(rank, step)
        qs, kvs = self.chunks_of(rank), self.chunks_of(owner)
        if not self.causal:
            return [Block(qs, kvs, False)]
        if owner == rank:
            return [Block(qs, kvs, True)]
        # a key chunk earlier than a query chunk is fully visible, a later one fully masked
        rows = [(qc, tuple(kc for kc in kvs if kc < qc)) for qc in qs]
        rows = [(qc, ks) for qc, ks in rows if ks]
        if not rows:
            return []
        if len({ks for _, ks in rows}) == 1:  # the same key chunks for every query chunk: one block
            return [Block(tuple(qc for qc, _ in rows), rows[0][1], False)]
        return [Block((qc,), ks, False) for qc, ks in rows]

    @cached_property  # read at every step of every attention call: built once
    def forward_steps(self) -> list[tuple[KVTransfer, ...]]:
        """p - 1 steps; in step s every rank r passes the K/V it computed with at step s - 1 to rank r + 1."""
        p = self.world_size
        return [tuple(KVTransfer(r, (r + 1) % p, self.owner_at(r, s - 1)) for r in range(p)) for s in range(1, p)]

    @cached_property
    def backward_steps(self) -> list[tuple[KVTransfer, ...]]:
        """p steps: p - 1 carrying K/V with the dK/dV summed so far, and a last one taking each dK/dV home."""
        p = self.world_size
        steps = [tuple(KVTransfer(r, (r + 1) % p, self.owner_at(r, s - 1), ("k", "v", "dk", "dv"))
                       for r in range(p)) for s in range(1, p)]
        steps.append(tuple(KVTransfer(r, (r + 1) % p, self.owner_at(r, p - 1), ("dk", "dv")) for r in range(p)))
        return steps

    def describe_step(self, index: int) -> str:
        """Caption of forward step ``index`` (0 = before any message), as the animation shows it."""
        total = self.world_size - 1
        if index == 0:
            return f"step 0 of {total}: every rank attends to its own K/V"
        parts = [t.describe() for t in self.forward_steps[index - 1]]
        return f"step {index} of {total}: " + ", ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")

    def check_length(self, seq_len: int) -> int:
        """The chunk length for a sequence of ``seq_len`` tokens; :class:`ConfigError` unless it splits evenly."""
        n = self.num_chunks
        if seq_len < n or seq_len % n:
            lower, upper = max(n, seq_len // n * n), (seq_len // n + 1) * n
            valid = f"{lower} or {upper}" if lower < upper else f"{upper}"
            raise ConfigError(f"context parallelism over {self.world_size} ranks ({self.layout}) cuts a sequence "
                              f"into {n} equal chunks: a length of {seq_len} does not split; use a multiple of {n}, "
                              f"e.g. {valid}")
        return seq_len // n

    def work(self, seq_len: int) -> list[int]:
        """Score entries (``q kᵀ`` elements) each rank computes in one forward, per batch row and head."""
        c = self.check_length(seq_len)
        return [sum(b.score_entries(c) for s in range(self.world_size) for b in self.blocks(r, s))
                for r in range(self.world_size)]

    def bytes_sent(self, batch: int, seq_len: int, width: int, itemsize: int, rank: int = 0) -> int:
        """Bytes ``rank`` sends for one attention layer, forward and backward, where every tensor it passes on
        is (batch, seq_len / p, width) with ``width`` = heads x head size: the count behind
        ``(6p - 4) * batch * seq_len / p * width * itemsize``."""
        block = batch * (seq_len // self.world_size) * width * itemsize
        steps = self.forward_steps + self.backward_steps
        return sum(len(t.tensors) * block for step in steps for t in step if t.src == rank)


def kv_ring(world_size: int, causal: bool = True, layout: str = "zigzag") -> KVRing:
    """The ring for ``world_size`` ranks (>= 1); :class:`ConfigError` for an unknown layout."""
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown context-parallel layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if world_size < 1:
        raise ConfigError(f"a ring needs at least one rank, got {world_size}")
    return KVRing(world_size, causal, layout)


class _CopiedBack:
    """The requests of a ring step staged through the CPU; ``wait()`` waits on them all, then copies the CPU
    buffer that received into the caller's tensor."""

    def __init__(self, requests: list, staged: torch.Tensor, recv: torch.Tensor) -> None:
        self.requests, self.staged, self.recv = requests, staged, recv

    def wait(self) -> None:
        for request in self.requests:
            request.wait()
        self.recv.copy_(self.staged)


def pass_on(send: torch.Tensor, recv: torch.Tensor, step: tuple[KVTransfer, ...], rank: int, group=None) -> list:
    """Post ``rank``'s part of one ring step (group ranks): send ``send`` where the step says, receive into
    ``recv`` what the step brings. Returns the requests; wait on them before reading ``recv``.

    gloo sends CPU tensors only: GPU tensors under gloo travel through CPU copies (one request then stands for
    the step, and its ``wait()`` copies the message into ``recv``)."""
    out = next(t for t in step if t.src == rank)
    into = next(t for t in step if t.dst == rank)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    device = comm_device(group)
    staged = send.device != device
    inbox, outbox = (torch.empty_like(recv, device=device), send.to(device)) if staged else (recv, send)
    ops = [dist.P2POp(dist.irecv, inbox, peer(into.src), group), dist.P2POp(dist.isend, outbox, peer(out.dst), group)]
    requests = dist.batch_isend_irecv(ops)
    return [_CopiedBack(requests, inbox, recv)] if staged else requests

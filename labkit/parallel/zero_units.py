"""ZeRO's flat parameter buckets: a :class:`Bucket` per run of consecutive modules that own parameters (rank r's
shard of its padded flat buffer, gathered and freed as :class:`~labkit.parallel.zero_sharding.ZeroSharding` needs
it), the rule that groups modules into buckets (:func:`plan_buckets`), the layout as data (:meth:`Bucket.layout`,
:func:`format_layout`), and :class:`Comm`, the all-gathers and reduce-scatters over one process group with the bytes
each rank sends counted.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from labkit.dist import group as kdist


def plan_buckets(sizes: list[float], cap_bytes: float) -> list[list[int]]:
    """The buckets of modules of ``sizes`` bytes of parameters (in module order) as lists of their indices.

    As DDP's buckets, filled from the last module backwards (the order backward produces gradients): a bucket takes
    the next module while its bytes stay within ``cap_bytes``; a module is never split, and one larger than the cap
    is a bucket of its own. Returned in module order, each bucket's modules in module order. The training
    (:class:`~labkit.parallel.zero_sharding.ZeroSharding`) and the advisor's price
    (:func:`labkit.parallel.zero.price_sharded`) cut the same buckets.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i in reversed(range(len(sizes))):
        if current and size + sizes[i] > cap_bytes:
            buckets.append(current[::-1])
            current, size = [], 0.0
        current.append(i)
        size += sizes[i]
    if current:
        buckets.append(current[::-1])
    return buckets[::-1]


class Bucket:
    """The parameters of one or more consecutive modules as a flat buffer of N·S elements, of which rank r owns
    elements [r·S, (r+1)·S): one reduce-scatter and one all-gather per bucket and step.

    ``full`` (N·S,) holds the gathered parameters (the modules' parameters are views into it, in order); ``shard``
    (S,) is what this rank's optimizer steps; ``grad`` (S,) this rank's slice of the averaged gradient.
    With ``keep_full_grad`` (stage 1) the gradients live in a persistent flat (N·S,) buffer, the parameters' ``.grad``
    are views into it and ``grad`` is its slice.
    """

    def __init__(self, modules: list[nn.Module], params: list[nn.Parameter], world: int, rank: int, comm: Comm,
                 keep_full_grad: bool):
        self.modules, self.params, self.comm, self.rank = modules, params, comm, rank
        self.numel = sum(p.numel() for p in self.params)
        self.size = math.ceil(self.numel / world)  # S
        first = self.params[0]
        self.full = torch.zeros(self.size * world, dtype=first.dtype, device=first.device)  # (N·S,)
        self.offsets = []
        offset = 0
        for p in self.params:
            self.full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.full[offset:offset + p.numel()].view_as(p)
            self.offsets.append(offset)
            offset += p.numel()
        self.padding = self.full.new_zeros(self.full.numel() - self.numel)
        self.slice = slice(rank * self.size, (rank + 1) * self.size)
        self.shard = nn.Parameter(self.full[self.slice])  # (S,) a view: stepping it updates `full`
        self.full_grad = torch.zeros_like(self.full) if keep_full_grad else None  # (N·S,) stage 1
        self.grad = self.full_grad[self.slice] if keep_full_grad else torch.zeros_like(self.shard.detach())  # (S,)
        self.pending = len(self.params)  # gradients backward has still to produce
        self.forwarded = 0  # modules whose forward ran since the bucket was gathered (stage 3)
        self.users = 0  # modules whose forward uses the bucket's parameters (stage 3: set by ZeroSharding.shard)
        self.gathered, self.handle = True, None
        self.reducing = None  # (work, flat or output buffer) of a reduce-scatter in flight

    def layout(self, names: dict[int, str]) -> dict:
        """The bucket as data: ``{"elements", "padded", "shard", "tensors": [{"name", "shape", "offset",
        "numel"}]}``, ``names`` mapping ``id(parameter)`` to its name."""
        return {"elements": self.numel, "padded": self.full.numel(), "shard": self.size,
                "tensors": [{"name": names.get(id(p), "?"), "shape": tuple(p.shape), "offset": o, "numel": p.numel()}
                            for p, o in zip(self.params, self.offsets)]}

    def shard_own_storage(self) -> None:
        """Stage 3: the shard becomes its own (S,) tensor and the full buffer is freed."""
        self.shard.data = self.full[self.slice].clone()
        self.free()

    def free(self) -> None:
        """Release the gathered parameters' memory; the parameter views keep their shapes for the next gather."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        self.forwarded = 0

    def zero_grad(self) -> None:
        """Stage 1: zero the flat gradient buffer; backward accumulates into the parameters' views of it."""
        self.full_grad.zero_()
        for p, offset in zip(self.params, self.offsets):
            p.grad = self.full_grad[offset:offset + p.numel()].view_as(p)

    def gather(self, wait: bool = True, force: bool = False) -> None:
        """All-gather every rank's shard into ``full`` (asynchronously if ``wait`` is False; a later call with
        ``wait`` waits for it).

        ``force``: gather even though ``full`` is allocated (stages 1 and 2 after each optimizer step).
        """
        if not self.gathered or force:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            self.handle = self.comm.all_gather(self.full, self.shard.detach().clone(), async_op=not wait)
            self.gathered = True
        if wait and self.handle is not None:
            self.handle.wait()
            self.handle = None

    def reduce_gradients(self, wait: bool = True) -> None:
        """g_shard ← (1/N) Σ_r g_r[r·S:(r+1)·S]: reduce-scatter the flat gradient (stages 2, 3: the parameters'
        gradients copied into one flat buffer and freed), asynchronously unless ``wait``; :meth:`finish_reduce`
        waits for it and averages."""
        if self.full_grad is not None:  # stage 1: the gradients already sit in the flat buffer
            out, flat = torch.empty_like(self.grad), self.full_grad
        else:  # an unused parameter contributes zeros, as the padding does
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in self.params] + [self.padding])  # (N·S,)
            for p in self.params:
                p.grad = None  # the full gradient is freed: only this rank's slice stays
            out = self.grad
        self.reducing = (self.comm.reduce_scatter(out, flat, async_op=not wait), out, flat)
        self.pending = len(self.params)
        if wait:
            self.finish_reduce()

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight (if any) and average: ``grad`` = this rank's slice of the mean."""
        if self.reducing is None:
            return
        work, out, _ = self.reducing
        if work is not None:
            work.wait()
        if out is not self.grad:
            self.grad.copy_(out)
        self.grad /= self.comm.world
        self.shard.grad = self.grad
        self.reducing = None


def format_layout(rows: list[dict], world: int) -> list[str]:
    """Lines describing :meth:`Bucket.layout` rows over ``world`` ranks: one per bucket, one per tensor."""
    total = sum(r["padded"] for r in rows)
    lines = [f"ZeRO buckets: {len(rows)} over {world} rank(s), {total:,} elements padded "
             f"({total * 4 / 2**20:.3f} MB in fp32): one reduce-scatter and one all-gather each per step"]
    for i, r in enumerate(rows):
        lines.append(f"bucket {i}: {r['elements']:,} elements, padded to {r['padded']:,}, {r['shard']:,} per rank")
        for t in r["tensors"]:
            shape = "x".join(str(s) for s in t["shape"]) or "scalar"
            lines.append(f"  [{t['offset']:>10,} : {t['offset'] + t['numel']:>10,})  {t['name']}  ({shape})")
    return lines


class Comm:
    """The strategy's collectives over ``group`` of N = ``world`` ranks (``None``: the whole job), counting the
    bytes each rank sends (ring algorithms: (N−1)/N of the buffer) and the calls.

    ``world`` must be ``group``'s size; ``distributed`` False: one process, the collectives are copies.
    """

    def __init__(self, world: int, distributed: bool, group=None):
        self.world, self.distributed, self.group = world, distributed, group
        self.sent_bytes = 0
        self.calls = 0

    def _count(self, full: torch.Tensor) -> None:
        self.sent_bytes += (self.world - 1) * full.numel() * full.element_size() // self.world
        self.calls += 1

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        self._count(full)
        if not self.distributed:
            full.copy_(shard)
            return None
        return kdist.all_gather_into_tensor(full, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        self._count(full)
        if not self.distributed:
            shard.copy_(full)
            return None
        return kdist.reduce_scatter_tensor(shard, full, group=self.group, async_op=async_op)

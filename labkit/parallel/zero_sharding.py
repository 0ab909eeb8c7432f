"""ZeRO's stages applied to one model over one process group: the model's modules grouped into
:class:`~labkit.parallel.zero_units.Bucket` s of about ``bucket_bytes`` (``--bucket-mb``, DDP's 25 MB by default),
the hooks that reduce-scatter a bucket's gradients as soon as backward has produced them (stages 1-3) and gather its
parameters before use (stage 3, a bucket ahead with ``prefetch``), and the step's end (all-gather the stepped
shards).

The mesh's ``dp`` dimension (:mod:`labkit.parallel.dp`, ``--dp-shard zero1|zero2|zero3``, and ``--strategy zero``,
its preset over every rank) shards over its ``dp`` group of N ranks, each rank r of it owning elements
``[r·S, (r+1)·S)`` of every bucket's flat buffer of N·S elements.

Per step (N ranks of the group, B buckets, P elements of padded flat buffers, ring collectives): B reduce-scatters
of the gradients and B all-gathers of the parameters, ``2 (N − 1)/N · P`` sent (stage 3: B more all-gathers,
``3 (N − 1)/N · P``). Nothing else: no host sync. A bucket's reduce-scatter runs while backward computes the
buckets before it, as DDP's all-reduce of a bucket does.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from labkit.parallel.data_parallel import DEFAULT_BUCKET_MB
from labkit.parallel.zero_units import Bucket, Comm, plan_buckets


class ZeroSharding:
    """ZeRO stage 1, 2 or 3 of one model over ``comm``'s group.

    Args:
        stage: 1 optimizer state, 2 + gradients, 3 + parameters.
        comm: the group's collectives (:class:`~labkit.parallel.zero_units.Comm`, ``comm.world`` = N).
        rank: this rank's index in the group.
        prefetch: stage 3: gather the next bucket's parameters while this one computes.
        reduce_in_backward: reduce-scatter a bucket's gradient as soon as backward has made it, asynchronously;
            False (a pipeline, whose micro-batches accumulate into the gradients): after backward, in
            :meth:`sync_gradients`.
        bucket_bytes: a bucket's parameters' bytes at most (:func:`~labkit.parallel.zero_units.plan_buckets`).
    """

    def __init__(self, stage: int, comm: Comm, rank: int, prefetch: bool = False, reduce_in_backward: bool = True,
                 bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20)):
        self.stage, self.comm, self.rank, self.prefetch = stage, comm, rank, prefetch
        self.reduce_in_backward, self.bucket_bytes = reduce_in_backward, bucket_bytes
        self.buckets: list[Bucket] = []
        self.names: dict[int, str] = {}

    def shard(self, model: nn.Module) -> None:
        """Each module owning trainable parameters (a parameter shared by two modules, such as a tied embedding and
        head, belongs to the first) into a bucket; the hooks of the stage."""
        self.names = {id(p): name for name, p in model.named_parameters()}
        claimed: set[int] = set()
        owners = []
        for m in model.modules():
            params = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in claimed]
            if params:
                claimed.update(id(p) for p in params)
                owners.append((m, params))
        sizes = [sum(p.numel() * p.element_size() for p in params) for _, params in owners]
        for indices in plan_buckets(sizes, self.bucket_bytes):
            self.buckets.append(Bucket([owners[i][0] for i in indices], [p for i in indices for p in owners[i][1]],
                                       self.comm.world, self.rank, self.comm, self.stage == 1))
        of_param = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        for i, bucket in enumerate(self.buckets):
            if self.reduce_in_backward:
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(lambda p, b=bucket: self._grad_ready(b))
            if self.stage == 3:
                bucket.shard_own_storage()
        if self.stage == 3:  # every module using a bucket's parameters, its owners and those sharing one (a tied head)
            for m in model.modules():
                for i in sorted({of_param[id(p)] for p in m.parameters(recurse=False) if id(p) in of_param}):
                    self.buckets[i].users += 1
                    m.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
                    m.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    def layout(self) -> list[dict]:
        """Each bucket as data (:meth:`~labkit.parallel.zero_units.Bucket.layout`): its tensors and offsets."""
        return [bucket.layout(self.names) for bucket in self.buckets]

    # ----- the step ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Before forward: stage 1's flat gradient buffers zeroed, the parameters' ``.grad`` views into them."""
        if self.stage == 1:
            for bucket in self.buckets:
                bucket.zero_grad()

    def _before_forward(self, i: int) -> None:
        self.buckets[i].gather()
        if self.prefetch and i + 1 < len(self.buckets):
            self.buckets[i + 1].gather(wait=False)

    def _after_forward(self, i: int, out) -> None:
        bucket = self.buckets[i]
        bucket.forwarded += 1
        if bucket.forwarded == bucket.users:  # the last module using the bucket has run
            bucket.free()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self.buckets[i].gather()
        if self.prefetch and i > 0:
            self.buckets[i - 1].gather(wait=False)

    def _grad_ready(self, bucket: Bucket) -> None:
        bucket.pending -= 1
        if bucket.pending == 0:  # the bucket's whole gradient exists: reduce-scatter it now, inside backward
            bucket.reduce_gradients(wait=False)
            if self.stage == 3:
                bucket.free()

    def sync_gradients(self) -> None:
        """After backward: reduce-scatter what backward has not (no hooks, a bucket with unused parameters), wait
        for the reduce-scatters in flight; stage 3 frees what is still gathered."""
        for bucket in self.buckets:
            if bucket.reducing is None:
                bucket.reduce_gradients(wait=False)
        for bucket in self.buckets:
            bucket.finish_reduce()
            if self.stage == 3 and bucket.gathered:
                bucket.gather()  # wait for a prefetch still in flight before freeing
                bucket.free()

    def after_step(self, optimizer, args, kwargs) -> None:
        """The optimizer's step post-hook: stages 1, 2 all-gather the stepped shards, every bucket's gather in
        flight at once (stage 3 gathers at the next forward); the shards' gradients dropped."""
        if self.stage < 3:
            for bucket in self.buckets:
                bucket.gather(wait=False, force=True)
            for bucket in self.buckets:
                bucket.gather()
        for bucket in self.buckets:
            bucket.shard.grad = None

    def build_optimizer(self, spec):
        """``spec``'s optimizer over this rank's shards only (its state: K·Ψ/N), gathering after each step."""
        optimizer, preconditioner = spec.build(nn.ParameterList([b.shard for b in self.buckets]))
        optimizer.register_step_post_hook(self.after_step)
        return optimizer, preconditioner

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole for the block (stage 3: the freed buckets all-gathered, and after the block their
        shards set from what it left in them, e.g. a checkpoint loaded, and freed again)."""
        freed = [bucket for bucket in self.buckets if not bucket.gathered]
        for bucket in freed:
            bucket.gather()
        try:
            yield
        finally:
            with torch.no_grad():
                for bucket in freed:
                    bucket.shard.copy_(bucket.full[bucket.slice])
                    bucket.free()

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter, whole, on every rank of the group (all-gathered for stage 3)."""
        with self.gathered():
            return [p.detach().clone() for bucket in self.buckets for p in bucket.params]

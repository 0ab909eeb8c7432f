"""ZeRO (Rajbhandari et al. 2020) from scratch: data parallelism whose per-rank memory falls as ranks are added.

    torchrun --nproc_per_node 4 -m labkit train --strategy zero --zero-stage 2 --model resnet20 --dataset cifar10

Every rank still trains on its own shard of each batch (as DDP), but the training *state* is split:

* stage 1 — optimizer state: each rank steps only its slice of every parameter buffer, then all-gathers;
* stage 2 — + gradients: reduce-scattered as backward produces them, so each rank keeps only its slice;
* stage 3 — + parameters: each bucket's weights are all-gathered just before its forward, again just before
  its backward, and freed after (``--zero-prefetch`` gathers the next bucket while this one computes).

As DDP, the collectives run per bucket: consecutive modules whose parameters fit in ``--bucket-mb`` (25 MB by
default) share one flat buffer, so a step makes one reduce-scatter and one all-gather per bucket, not per tensor
(``--print-buckets`` prints which tensors sit at which offsets of which bucket).

Memory per rank, in the paper's notation: Ψ parameters, N ranks, K bytes of optimizer state per parameter.
The paper counts mixed precision, (2 + 2 + K)Ψ with K = 12 for Adam; labkit trains in fp32, so

    DDP       (4 + 4 + K) Ψ
    stage 1   (4 + 4) Ψ + K Ψ / N          K = 4 SGD with momentum, 8 Adam, 0 plain SGD
    stage 2   4 Ψ + (4 + K) Ψ / N
    stage 3   (4 + 4 + K) Ψ / N

Each bucket is one flat buffer padded to a multiple of N, so Ψ here is
P = Σ_bucket N·⌈Ψ_bucket / N⌉ (at most N − 1 extra elements per bucket).

Communication per step, per rank (ring collectives: a reduce-scatter or all-gather over a buffer of P
elements sends (N − 1)/N · P; an all-reduce is one of each):

    DDP, stage 1, stage 2   reduce-scatter gradients + all-gather parameters   2 (N − 1)/N · P  (an all-reduce)
    stage 3                 all-gather (forward) + all-gather (backward) + reduce-scatter   3 (N − 1)/N · P  (1.5×)

K-FAC, LARS and LAMB are refused (:func:`labkit.parallel.dp.refuse_layerwise`): they need each layer's whole gradient (K-FAC also
its activations) or whole-weight norms on one rank, which a rank's slice of a flat buffer does not give.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import broadcast_time, collective_time, common_terms, compute_scale, memory_terms
from labkit.dist.group import print0
from labkit.errors import ConfigError
from labkit.parallel.data_parallel import DEFAULT_BUCKET_MB
from labkit.parallel.dp import DataParallelPreset
from labkit.parallel.zero_units import Bucket, Comm, plan_buckets
from labkit.strategies.backends import check as check_backend

__all__ = ["ZeroStrategy", "price_sharded", "stage_of"]

#: ``labkit train --strategy zero`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--zero-stage", "type": "int", "range": "[1, 3]", "default": 1, "metavar": "1|2|3",
     "help": "what is sharded: 1 optimizer state, 2 + gradients, 3 + parameters"},
    {"flag": "--zero-prefetch", "action": "store_true",
     "help": "stage 3: all-gather the next bucket's parameters while this bucket computes"},
]
#: flags declared once by another module and shared (labkit.parallel.dimension_flags): the bucket size (DDP's
#: ``--bucket-mb``) and the dp dimension's ``--print-buckets``
SHARED_FLAGS = {"labkit.parallel.ddp": ["--bucket-mb"], "labkit.parallel.dp": ["--print-buckets"]}
#: ``labkit advise``: ``p`` ranks each on ``B/p`` samples, every stage (labkit.advisor.search)
ADVISOR = {"price": "labkit.parallel.zero:price_sharded", "plans": "spread", "batch": "split",
           "grid": {"zero_stage": [1, 2, 3]}}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 2, "flags": ["--zero-stage", "3"]}
#: backend/device combinations it cannot run on (labkit.strategies.backends)
BACKENDS = [
    {"backend": "gloo", "device": "cuda",
     "why": "--strategy zero's all-gathers and reduce-scatters run on CPU tensors only under gloo; use --backend "
            "nccl on GPUs, or --device cpu (or leave --device auto)"},
]


class ZeroStrategy(DataParallelPreset):
    """``--strategy zero --zero-stage k``: a preset of ``--mesh dp=N --dp-shard zerok`` over every rank of the job
    (the dp dimension's :class:`~labkit.parallel.zero_sharding.ZeroSharding`; see the module docstring for the
    formulas). Its counters: :attr:`comm` (bytes sent, calls), :meth:`memory_bytes`, :meth:`full_parameters`;
    :attr:`buckets` and :meth:`layout`, the buckets as data."""

    name = "zero"

    def shard_of(self, options: dict) -> str:
        stage = options.get("zero_stage")
        stage = 1 if stage is None else stage
        if stage not in (1, 2, 3):
            raise ConfigError(f"--zero-stage must be 1, 2 or 3 (optimizer state, + gradients, + parameters), "
                              f"got {stage}")
        if options.get("zero_prefetch") and stage != 3:
            raise ConfigError(f"--zero-prefetch gathers parameters ahead of use, which only stage 3 shards; "
                              f"got --zero-stage {stage}")
        return f"zero{stage}"

    def __init__(self, env, options=None):
        if env.backend is not None:  # labkit train checked this already; a strategy built by hand is checked here
            check_backend("zero", env.backend, env.device.type)
        super().__init__(env, options)
        self.stage = int(self.shard[-1])
        self.prefetch = bool(self.options.get("zero_prefetch"))
        self._alone = Comm(1, False)  # one process: nothing is sent
        self._model: nn.Module | None = None

    @property
    def comm(self) -> Comm:
        """The dp group's collectives and their byte counters (``comm.sent_bytes``)."""
        return self.dp.zero.comm if self.dp is not None else self._alone

    @property
    def buckets(self) -> list[Bucket]:
        """The model's buckets (:class:`~labkit.parallel.zero_units.Bucket`), in module order (none in one
        process)."""
        return self.dp.zero.buckets if self.dp is not None else []

    def layout(self) -> list[dict]:
        """The buckets as data: which tensors at which offsets (:meth:`~labkit.parallel.zero_units.Bucket.layout`)."""
        return self.dp.zero.layout() if self.dp is not None else []

    def prepare(self, model: nn.Module) -> nn.Module:
        self._model = super().prepare(model)
        if self.dp is None and self.options.get("print_buckets"):
            print0("ZeRO buckets: none in one process (nothing is sharded or sent)")
        return self._model

    def memory_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds now: ``{"params", "grads", "optimizer"}`` (distinct storages; the 0-d step
        counters excluded), to set beside the formulas."""
        storages: dict[str, dict[int, int]] = {"params": {}, "grads": {}, "optimizer": {}}
        if self.buckets:
            params = [t for b in self.buckets for t in [*b.params, b.shard]]
            grads = [t for b in self.buckets for t in [b.grad, *(p.grad for p in b.params)] if t is not None]
        else:  # one process: the optimizer's parameters, whole
            params = [p for group in optimizer.param_groups for p in group["params"]]
            grads = [p.grad for p in params if p.grad is not None]
        for t in params:
            storages["params"][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for t in grads:
            storages["grads"][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for state in optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    storages["optimizer"][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        storages["params"].pop(0, None)  # a freed stage-3 buffer
        return {k: sum(v.values()) for k, v in storages.items()}

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter, whole, on every rank (all-gathered for stage 3): for tests and notebooks."""
        if self.dp is not None:
            return self.dp.zero.full_parameters()
        return [p.detach().clone() for p in self._model.parameters()]


def _units(prof) -> list[float]:
    return [layer.param_bytes / layer.units for layer in prof.layers if layer.param_bytes for _ in range(layer.units)]


def _buckets(units: list[float], bucket_mb: float) -> list[float]:
    """The bytes of ZeRO's buckets over ``units`` (:func:`~labkit.parallel.zero_units.plan_buckets`, as training
    cuts them)."""
    return [sum(units[i] for i in bucket) for bucket in plan_buckets(units, bucket_mb * 2**20)]


def stage_of(plan) -> int:
    """ZeRO's stage, or FSDP's equivalent: 3 (reshard after forward) or 2 (``--fsdp-no-reshard``)."""
    if plan.strategy == "fsdp":
        return 2 if plan.option.get("fsdp_no_reshard") else 3
    return plan.option.get("zero_stage", 1)


def price_sharded(plan, prof, topo) -> Estimate:
    """ZeRO (``--zero-stage 1|2|3``) and FSDP (reshard after forward, or ``--fsdp-no-reshard``), ``b = B/p``:

    ``compute = s·T_all(b)``; ``communication = Σ_units C_reduce_scatter(U) + g·C_all_gather(U)``
    (:func:`labkit.advisor.topology.collective_time`: each collective pays its messages' α, unit by unit; ZeRO's
    units are its buckets of the profile's layers, ``--bucket-mb`` (25 MB) each at most, FSDP2's the layers) with
    ``g = 1`` (ZeRO 1, 2: gather the stepped parameters; FSDP no-reshard: gather once before forward) or
    ``g = 2`` (ZeRO 3, FSDP: gather before forward and again before backward), ``+ BC(N_buf, n_buf)`` for ZeRO,
    which broadcasts each of the model's ``N_buf`` buffers from rank 0 before every forward
    (:func:`labkit.advisor.topology.broadcast_time`; FSDP leaves buffers alone). FSDP2's own work beyond its
    collectives (its hooks, the optimizer over DTensors) is not priced. Memory (fp32, momentum: optimizer state = P):
    stage 1 ``2P + P/p``; stage 2 ``P + 2P/p``; stage 3 / FSDP ``3P/p + 2·max U`` (a gathered unit (bucket) and
    its prefetched neighbour); FSDP no-reshard ``P + 2P/p`` (gathered parameters live from forward to backward);
    plus activations ``M_all(b)``.
    """
    p, b, P = plan.processes, plan.batch_size / plan.processes, prof.param_bytes
    stage = stage_of(plan)
    units = _units(prof)
    if plan.strategy == "zero":  # ZeRO's collectives run per bucket, FSDP2's per unit
        units = _buckets(units, plan.option.get("bucket_mb") or DEFAULT_BUCKET_MB)
    gathers = 2 if stage == 3 else 1
    comm = sum(collective_time("reduce_scatter", u, p, topo) + collective_time("all_gather", u, p, topo, gathers)
               for u in units)
    if plan.strategy == "zero":
        comm += broadcast_time(*prof.buffers, p, topo)
    time = {"compute": compute_scale(topo, p, prof) * prof.time(b), "communication": comm,
            **common_terms(prof, topo, P / p, b)}
    memory = memory_terms(prof, topo, P, prof.saved_bytes(b))
    if stage == 1:
        memory["optimizer"] = P / p
    elif stage == 2:
        memory["gradients"] = memory["optimizer"] = P / p
    else:
        memory.update(parameters=P / p, gradients=P / p, optimizer=P / p, buffers=2 * max(units, default=0.0))
    return Estimate(plan, time, memory)

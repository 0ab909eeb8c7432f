"""The ``dp`` dimension of a mesh: data parallelism over the mesh's ``dp`` groups.

    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --model gpt-tiny --dataset text-sample
    ... --mesh dp=2,tp=2 --dp-shard fsdp     # FSDP2 over dp, on top of tensor parallelism

Each ``dp`` group holds ``size`` copies of the same (tp-sharded, pp-cut) model, every copy its own shard
of each batch (the sampler shards by the rank's ``dp`` coordinate). The mean loss over the global batch is
the mean of the shards' means, so its gradient is the mean of theirs:

    ∇L = (1/dp) Σ_r ∇L_r

``--dp-shard none`` (default): the copies start equal (broadcast from the group's first rank) and the
gradients are averaged after backward by labkit's bucketed all-reduce over the ``dp`` group only: one all-reduce
per 25 MB bucket per step, nothing else. ``--allreduce`` (the flag of ``--strategy ddp``, shared) chooses its
algorithm: ``ddp`` (default) and ``native`` both call ``dist.all_reduce`` per bucket (on a mesh the buckets are
reduced after backward, not overlapped with it as DistributedDataParallel's are), ``ring``, ``tree``, ... run
labkit's own schedule over the group.
``--dp-shard zero1|zero2|zero3``: labkit's ZeRO (:mod:`labkit.parallel.zero_sharding`) over the ``dp`` group of
``d`` ranks: stage 1 shards the optimizer state, 2 also the gradients (reduce-scattered inside backward; after
it, once the other dimensions have summed them, under pp, cp, ep or tp's sequence parallelism), 3 also the
parameters; per step ``2 (d − 1)/d · P`` sent for stages 1, 2 and ``3 (d − 1)/d · P`` for 3 (``P``: this rank's
tp/pp part, padded). ``--allreduce`` other than ``ddp``/``native`` is refused with a sharded dp.
Stage 3 is refused under ``pp``: its gathers around each layer's forward and backward would run once per
micro-batch.
``--dp-shard fsdp``: FSDP2 ``fully_shard`` over ``mesh["dp"]``: every parameter — a tp shard already, when
``tp`` > 1, as torchtitan composes them — is split once more along dim 0 over the dp ranks, all-gathered for
forward and backward, its gradient reduce-scattered (averaged) during backward.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import group as kdist
from labkit.errors import ConfigError
from labkit.parallel.base import Dimension
from labkit.parallel.data_parallel import DEFAULT_BUCKET_MB, average_gradients
from labkit.parallel.ddp import ALLREDUCE_MODES
from labkit.parallel.zero import refuse_layerwise
from labkit.parallel.zero_sharding import ZeroSharding
from labkit.parallel.zero_units import Comm

#: ``--dp-shard`` values: replicas, labkit's ZeRO stages, FSDP2
SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")

#: ``labkit train --mesh ...`` flags of this dimension, plain data read without importing it (labkit.flags)
FLAGS = [
    {"flag": "--dp-shard", "default": "none", "choices": ["none", "zero1", "zero2", "zero3", "fsdp"],
     "help": "dp dimension: none = replicas + bucketed gradient all-reduce (--allreduce); zero1|zero2|zero3 = "
             "labkit's ZeRO stage 1-3 over the dp groups; fsdp = FSDP2 fully_shard over the dp groups"},
]
#: flags declared once by another module and shared (labkit.parallel.dimension_flags): ``--strategy ddp``'s
#: gradient all-reduce algorithm
SHARED_FLAGS = {"labkit.parallel.ddp": ["--allreduce"]}
#: ``labkit advise --model gpt-*``'s mesh search (labkit.parallel.pricing): the pricing function below
ADVISOR = {"price": "labkit.parallel.dp:mesh_time"}


def price(param_bytes: float, size: int, shard: str = "none") -> dict[str, float]:
    """Bytes one rank sends per step over its ``dp`` group of ``d`` ranks, for ``P`` bytes of (this rank's)
    parameters, on ring collectives:

    * ``none``: one all-reduce of the gradients, ``2·(d − 1)/d·P``;
    * ``fsdp``: per step a reduce-scatter of the gradients and two all-gathers of the parameters (before
      forward, again before backward: FSDP2 reshards after forward), ``3·(d − 1)/d·P``;
    * ``zero1``, ``zero2``: a reduce-scatter of the gradients and an all-gather of the stepped parameters,
      ``2·(d − 1)/d·P``; ``zero3``: as ``fsdp``, ``3·(d − 1)/d·P`` (``P`` padded to a multiple of ``d`` per unit).

    ``d = 1`` sends nothing.
    """
    collectives = {"none": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3}[shard]
    return {"bytes": collectives * (size - 1) / size * param_bytes if size > 1 else 0.0}



class DataParallel(Dimension):
    """Replicas, ZeRO shards or FSDP2 shards of the model over the ``dp`` groups, gradients averaged over them.

    Attributes:
        shard: ``--dp-shard``. allreduce: ``--allreduce``, the algorithm of the replicas' all-reduce.
        algorithm: the one :func:`~labkit.parallel.data_parallel.average_gradients` runs (``ddp`` -> ``native``).
        zero: the ZeRO stages' :class:`~labkit.parallel.zero_sharding.ZeroSharding` over the group, or None.
    """

    name = "dp"

    def __init__(self, mesh, options):
        super().__init__(mesh, options)
        self.shard = self.options.get("dp_shard") or "none"
        if self.shard not in SHARDS:
            raise ConfigError(f"unknown --dp-shard {self.shard!r}; choose one of {', '.join(SHARDS)}")
        self.allreduce = self.options.get("allreduce") or "ddp"
        if self.allreduce not in ALLREDUCE_MODES:
            raise ConfigError(f"unknown --allreduce {self.allreduce!r}; choose one of {', '.join(ALLREDUCE_MODES)}")
        if self.shard != "none" and self.allreduce not in ("ddp", "native"):
            raise ConfigError(f"--allreduce {self.allreduce} chooses how replicas' gradients are all-reduced, but "
                              f"--dp-shard {self.shard} reduce-scatters them; leave --allreduce out or use "
                              "--dp-shard none")
        self.algorithm = "native" if self.allreduce == "ddp" else self.allreduce
        self.averages_gradients = self.size > 1 and self.shard == "none"
        self.bucket_bytes = int(DEFAULT_BUCKET_MB * 2**20)
        sizes = {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names)}
        self.pipelined = sizes.get("pp", 1) > 1
        self.zero = None
        if self.shard.startswith("zero"):
            # stage 2's reduce-scatter inside backward takes each gradient off its parameter; where another
            # dimension still sums or averages gradients after backward (pp's tied embedding and micro-batches,
            # cp, ep, tp's sequence-parallel norms) it waits for them, after backward (sync_last)
            others = (self.pipelined or sizes.get("cp", 1) > 1 or sizes.get("ep", 1) > 1
                      or (sizes.get("tp", 1) > 1 and bool(self.options.get("sequence_parallel"))))
            comm = Comm(self.size, self.size > 1, group=self.group)
            self.zero = ZeroSharding(int(self.shard[-1]), comm, self.rank, reduce_in_backward=not others)
            self.sync_last = True

    @property
    def data_parallel_size(self) -> int:
        return self.size

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        if self.shard == "zero3" and self.pipelined:
            raise ConfigError("--dp-shard zero3 with pp > 1 is not supported: stage 3 gathers each layer's parameters "
                              "around its forward and backward, which the pipeline's micro-batches interleave; use "
                              "--dp-shard zero1 or zero2, or fsdp")

    def parallelize(self, model: nn.Module) -> nn.Module:
        if self.size == 1:
            return model
        # every copy starts from the group's first rank's (as DDP does; fully_shard keeps this rank's slice of
        # its own copy, so it too must start from one copy)
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                kdist.broadcast(tensor, src=src, group=self.group)
        if self.zero is not None:
            self.zero.shard(model)
        return self._fully_shard(model) if self.shard == "fsdp" else model

    def _fully_shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        submesh = self.mesh["dp"]
        for module in _units(model):
            fully_shard(module, mesh=submesh)
        return fully_shard(model, mesh=submesh)

    def whole_parameters(self) -> contextlib.AbstractContextManager:
        """A block in which every parameter of this rank's model is whole (``--dp-shard zero3``: all-gathered over
        the group, :meth:`labkit.parallel.zero_sharding.ZeroSharding.gathered`; collective); else nothing to do."""
        return self.zero.gathered() if self.zero is not None else contextlib.nullcontext()

    def state_key(self) -> dict:
        return {"dp": self.size, "dp_shard": self.shard}  # fsdp and ZeRO shards do not load into replicas

    def begin_step(self) -> None:
        if self.zero is not None:
            self.zero.begin_step()

    def sync_gradients(self, model: nn.Module) -> None:
        if self.zero is not None:
            self.zero.sync_gradients()
            return
        if self.size == 1 or self.shard == "fsdp":  # FSDP2 reduce-scattered them during backward
            return
        average_gradients(model.parameters(), self.algorithm, self.bucket_bytes, group=self.group)

    def build_optimizer(self, model: nn.Module, spec):
        """``spec``'s optimizer: over this rank's ZeRO shards (``--dp-shard zero*``), else over ``model``'s
        parameters (FSDP2's are shards of their own). Layer-wise optimizers are refused where a rank holds only
        part of each layer."""
        if self.zero is not None:
            refuse_layerwise(spec.name, f"mesh --dp-shard {self.shard}", "a slice of each layer's flat buffer")
            return self.zero.build_optimizer(spec)
        if self.shard == "fsdp":
            refuse_layerwise(spec.name, "mesh --dp-shard fsdp", "a shard of each tensor")
        return spec.build(model)


def _units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units of their own: every module owning parameters, except those sharing
    one with another module (a tied embedding and head stay with the root, so the tie survives)."""
    owners = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    seen: dict[int, int] = {}
    for m in owners:
        for p in m.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return [m for m in owners if all(seen[id(p)] == 1 for p in m.parameters(recurse=False))]


def mesh_time(step) -> float:
    """A mesh step's ``dp`` term (:class:`labkit.parallel.pricing.MeshStep`): for each group of ``d`` ranks holding
    the same ``P`` bytes (:attr:`~labkit.parallel.pricing.MeshStep.replicas`), ``n·β + 2(d − 1)·α`` with ``n`` the
    bytes of :func:`price` (``fsdp`` at ZeRO 3, else ``none``: ZeRO 1-2's reduce-scatter + all-gather move an
    all-reduce's bytes). Nothing overlaps with backward: an upper bound."""
    shard = "fsdp" if step.plan.zero == 3 else "none"
    total = 0.0
    for nbytes, d, stride in step.replicas:
        if d > 1:
            link = step.link(d, stride)
            total += price(nbytes, d, shard)["bytes"] * link.beta + 2 * (d - 1) * link.alpha
    return total

"""The ``dp`` dimension of a mesh: data parallelism over the mesh's ``dp`` groups.

    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --model gpt-tiny --dataset text-sample
    ... --mesh dp=2,tp=2 --dp-shard fsdp     # FSDP2 over dp, on top of tensor parallelism

Each ``dp`` group holds ``size`` copies of the same (tp-sharded, pp-cut) model, every copy its own shard
of each batch (the sampler shards by the rank's ``dp`` coordinate). The mean loss over the global batch is
the mean of the shards' means, so its gradient is the mean of theirs:

    ∇L = (1/dp) Σ_r ∇L_r

``--dp-shard none`` (default): the copies start equal (broadcast from the group's first rank) and the
gradients are averaged over the ``dp`` group only: one all-reduce per 25 MB bucket (``bucket_mb``) per step,
nothing else. ``--allreduce`` (the flag of ``--strategy ddp``, shared) chooses how: ``ddp`` (default) wraps the
model in PyTorch's DistributedDataParallel when dp is the mesh's only dimension (each gradient divided by ``dp``,
then its bucket all-reduced while backward runs; the model's buffers broadcast from the group's first rank in
every forward), else calls ``dist.all_reduce`` per bucket after backward, as ``native`` always does (sum, then
divide); ``ring``, ``tree``, ... run labkit's own schedule over the group after backward.
``--dp-shard zero1|zero2|zero3``: labkit's ZeRO (:mod:`labkit.parallel.zero_sharding`) over the ``dp`` group of
``d`` ranks: stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters. The modules are
grouped into buckets of at most ``bucket_mb`` (``--bucket-mb``, as DDP's; ``--print-buckets`` prints them), each
one flat buffer: one reduce-scatter per bucket, launched inside backward as soon as the bucket's gradients exist
(after backward, once the other dimensions have summed them, under pp, cp, ep or tp's sequence parallelism), and
one all-gather per bucket (stage 3: before forward and again before backward, a bucket ahead with
``zero_prefetch``); per step ``2 (d − 1)/d · P`` sent for stages 1, 2 and ``3 (d − 1)/d · P`` for 3 (``P``: this
rank's tp/pp part, padded), and each of the model's buffers (e.g. batch-norm statistics) broadcast from the
group's first rank before forward, as DDP does. ``zero_prefetch`` (``--strategy zero``'s ``--zero-prefetch``): stage 3 gathers
the next layer while this one computes. ``--allreduce`` other than ``ddp``/``native`` is refused with a sharded dp.
Stage 3 is refused under ``pp``: its gathers around each layer's forward and backward would run once per
micro-batch.
``--dp-shard fsdp``: FSDP2 ``fully_shard`` over ``mesh["dp"]``: every parameter — a tp shard already, when
``tp`` > 1, as torchtitan composes them — is split once more along dim 0 over the dp ranks, all-gathered for
forward and backward, its gradient reduce-scattered (averaged) during backward; ``fsdp_no_reshard``
(``--strategy fsdp``'s ``--fsdp-no-reshard``) keeps the gathered parameters from forward to backward.

``--strategy ddp``, ``zero`` and ``fsdp`` are presets of this dimension over every rank (:class:`DataParallelPreset`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from labkit.collectives import ALGORITHMS
from labkit.dist import group as kdist
from labkit.dist.group import print0
from labkit.errors import ConfigError
from labkit.parallel.base import Dimension
from labkit.parallel.data_parallel import DEFAULT_BUCKET_MB, average_gradients
from labkit.parallel.local_sgd import build as build_sync
from labkit.parallel.local_sgd import read_sync
from labkit.parallel.mesh import MeshStrategy
from labkit.parallel.zero_sharding import ZeroSharding
from labkit.parallel.zero_units import Comm, format_layout

#: ``--dp-shard`` values: replicas, labkit's ZeRO stages, FSDP2
SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")
#: what one rank holds of each layer under a sharded dp (the end of a layer-wise optimizer's refusal)
HOLDS = {"zero1": "a slice of each layer's flat buffer", "zero2": "a slice of each layer's flat buffer",
         "zero3": "a slice of each layer's flat buffer", "fsdp": "a shard of each tensor"}
#: ``--allreduce`` values: real DDP, ``dist.all_reduce`` by hand, or one of labkit's schedules
ALLREDUCE_MODES: tuple[str, ...] = ("ddp", "native") + ALGORITHMS

#: ``labkit train --mesh ...`` flags of this dimension, plain data read without importing it (labkit.flags)
FLAGS = [
    {"flag": "--dp-shard", "default": "none", "choices": ["none", "zero1", "zero2", "zero3", "fsdp"],
     "help": "dp dimension: none = replicas + bucketed gradient all-reduce (--allreduce); zero1|zero2|zero3 = "
             "labkit's ZeRO stage 1-3 over the dp groups; fsdp = FSDP2 fully_shard over the dp groups"},
    {"flag": "--print-buckets", "action": "store_true",
     "help": "ZeRO (--dp-shard zero1|zero2|zero3, --strategy zero): print each gradient/parameter bucket's tensors "
             "and offsets (its size: --bucket-mb)"},
]
#: flags declared once by another module and shared (labkit.parallel.dimension_flags): ``--strategy ddp``'s
#: gradient all-reduce algorithm
SHARED_FLAGS = {"labkit.parallel.ddp": ["--allreduce", "--bucket-mb"],
                "labkit.parallel.local_sgd": ["--sync", "--sync-every", "--outer-lr", "--outer-momentum"]}
#: ``labkit advise --model gpt-*``'s mesh search (labkit.parallel.pricing): the pricing function below
ADVISOR = {"price": "labkit.parallel.dp:mesh_time"}


def read_options(options: dict) -> tuple[str, str, float]:
    """``(dp_shard, allreduce, bucket_mb)`` from the parsed options, defaults filled in.

    Raises:
        ConfigError: an unknown shard or algorithm, a bucket size <= 0, labkit's all-reduce schedules with a
            sharded dp (whose gradients are reduce-scattered, not all-reduced), or ``--print-buckets`` without ZeRO.
    """
    shard = options.get("dp_shard") or "none"
    if shard not in SHARDS:
        raise ConfigError(f"unknown --dp-shard {shard!r}; choose one of {', '.join(SHARDS)}")
    allreduce = options.get("allreduce") or "ddp"
    if allreduce not in ALLREDUCE_MODES:
        raise ConfigError(f"unknown --allreduce {allreduce!r}; choose one of {', '.join(ALLREDUCE_MODES)}")
    if shard != "none" and allreduce not in ("ddp", "native"):
        raise ConfigError(f"--allreduce {allreduce} chooses how replicas' gradients are all-reduced, but "
                          f"--dp-shard {shard} reduce-scatters them; leave --allreduce out or use --dp-shard none")
    bucket_mb = options.get("bucket_mb") or DEFAULT_BUCKET_MB
    if bucket_mb <= 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {bucket_mb}")
    if options.get("print_buckets") and not shard.startswith("zero"):
        raise ConfigError(f"--print-buckets prints ZeRO's buckets, but --dp-shard {shard} has none of labkit's; "
                          "use --dp-shard zero1|zero2|zero3 or --strategy zero")
    return shard, allreduce, float(bucket_mb)


def refuse_layerwise(optimizer: str, strategy: str, holds: str) -> None:
    """ConfigError for an optimizer that needs whole layers on one rank (K-FAC's factors, LARS/LAMB's norms, the
    matrices of Shampoo, SOAP and Muon, which split whole matrices over the ranks themselves)."""
    needs = {"kfac": "K-FAC needs each layer's whole gradient and activations",
             "lars": "LARS scales each layer's step by its whole weight and gradient norms",
             "lamb": "LAMB scales each layer's step by its whole weight and update norms",
             "shampoo": "Shampoo preconditions each weight matrix with its whole L and R",
             "soap": "SOAP rotates each weight matrix into the eigenbasis of its whole L and R",
             "muon": "Muon orthogonalises each whole weight matrix"}
    if optimizer in needs or optimizer.startswith("kfac"):
        raise ConfigError(f"--optimizer {optimizer} with --strategy {strategy}: {needs.get(optimizer, needs['kfac'])}"
                          f" on one rank, but each rank holds only {holds}; use --strategy ddp, or sgd/adam")


def fsdp_refusal(label: str, device_type: str) -> str | None:
    """Why FSDP2 cannot shard on this torch's ``device_type`` ranks (one line), or None. On CPU ranks FSDP2 records
    events on the CPU stream (``torch.cpu.Stream.record_event``), which torch 2.7 added: torch 2.6 fails there with an
    AttributeError in the first forward."""
    if device_type == "cpu" and not hasattr(torch.cpu.Stream, "record_event"):
        return (f"{label} on CPU ranks needs torch 2.7 or later (FSDP2 records events on the CPU stream, which torch "
                f"2.7 added), this is torch {torch.__version__}; use --strategy zero --zero-stage 3 (the same "
                "sharding, labkit's own) or GPUs")
    return None


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
        wraps_ddp: replicas in PyTorch's DistributedDataParallel (``--allreduce ddp``, dp the only dimension).
        zero: the ZeRO stages' :class:`~labkit.parallel.zero_sharding.ZeroSharding` over the group, or None.
        label: how refusals name it (``mesh --dp-shard zero2``; a preset: its strategy's name).
    """

    name = "dp"

    def __init__(self, mesh, options):
        super().__init__(mesh, options)
        self.shard, self.allreduce, self.bucket_mb = read_options(self.options)
        self.label = self.options.get("preset") or f"mesh --dp-shard {self.shard}"
        self.holds = HOLDS.get(self.shard, "a whole replica")  # of each layer
        self.sync, self.sync_every, self.outer_lr, self.outer_momentum = read_sync(self.options)
        self.periodic = None  # --sync local-sgd|diloco: the meetings every H steps (built with the optimizer)
        if self.sync != "every-step" and (self.shard != "none" or self.allreduce != "ddp"):
            what = f"--dp-shard {self.shard}" if self.shard != "none" else f"--allreduce {self.allreduce}"
            raise ConfigError(f"--sync {self.sync} averages whole replicas every --sync-every steps, but {what} "
                              "shards or all-reduces gradients every step; leave it out (or use --sync every-step)")
        self.algorithm = "native" if self.allreduce == "ddp" else self.allreduce
        self.bucket_bytes = int(self.bucket_mb * 2**20)
        sizes = {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names)}
        alone = all(size == 1 for n, size in sizes.items() if n != "dp")
        every_step = self.sync == "every-step"
        self.wraps_ddp = self.size > 1 and self.shard == "none" and self.allreduce == "ddp" and alone and every_step
        self.averages_gradients = self.size > 1 and self.shard == "none" and not self.wraps_ddp and every_step
        self.reshard = not self.options.get("fsdp_no_reshard")
        self.buffers: list[torch.Tensor] = []
        self.pipelined = sizes.get("pp", 1) > 1
        self.zero = None
        if self.shard.startswith("zero"):
            # stage 2's reduce-scatter inside backward takes each gradient off its parameter; where another
            # dimension still sums or averages gradients after backward (pp's tied embedding and micro-batches,
            # cp, ep, tp's sequence-parallel norms) it waits for them, after backward (sync_last)
            others = (self.pipelined or sizes.get("cp", 1) > 1 or sizes.get("ep", 1) > 1
                      or (sizes.get("tp", 1) > 1 and bool(self.options.get("sequence_parallel"))))
            comm = Comm(self.size, self.size > 1, group=self.group)
            self.zero = ZeroSharding(int(self.shard[-1]), comm, self.rank, bool(self.options.get("zero_prefetch")),
                                     reduce_in_backward=not others, bucket_bytes=self.bucket_bytes)
            self.sync_last = True

    @property
    def data_parallel_size(self) -> int:
        return self.size

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        label = "--strategy fsdp" if self.options.get("preset") else "--dp-shard fsdp"
        if self.shard == "fsdp" and self.size > 1 and (why := fsdp_refusal(label, self.mesh.device_type)):
            raise ConfigError(why)
        if self.shard == "zero3" and self.pipelined:
            raise ConfigError("--dp-shard zero3 with pp > 1 is not supported: stage 3 gathers each layer's parameters "
                              "around its forward and backward, which the pipeline's micro-batches interleave; use "
                              "--dp-shard zero1 or zero2, or fsdp")

    def parallelize(self, model: nn.Module) -> nn.Module:
        if self.size == 1:
            return model
        if self.wraps_ddp:  # DDP broadcasts the group's first rank's parameters and buffers at construction
            device = next(model.parameters()).device
            return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                           bucket_cap_mb=self.bucket_mb, process_group=self.group)
        # every copy starts from the group's first rank's (as DDP does; fully_shard keeps this rank's slice of
        # its own copy, so it too must start from one copy)
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                kdist.broadcast(tensor, src=src, group=self.group)
        if self.zero is not None:
            self.zero.shard(model)
            self.buffers = list(model.buffers())
            if self.options.get("print_buckets"):
                print0("\n".join(format_layout(self.zero.layout(), self.size)))
        return self._fully_shard(model) if self.shard == "fsdp" else model

    def _fully_shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 over ``mesh["dp"]``. ``fully_shard`` puts a new DTensor parameter in each parameter's place, without
        the attributes other dimensions set on it (tp's sequence-parallel mark,
        :func:`labkit.parallel.layers.mark_sequence_parallel`): they are carried over by name."""
        from torch.distributed.fsdp import fully_shard

        marks = {name: dict(vars(p)) for name, p in model.named_parameters() if vars(p)}
        submesh = self.mesh["dp"]
        for module in _units(model):
            fully_shard(module, mesh=submesh, reshard_after_forward=self.reshard)
        model = fully_shard(model, mesh=submesh, reshard_after_forward=self.reshard)
        params = dict(model.named_parameters())
        for name, attributes in marks.items():
            for key, value in attributes.items():
                setattr(params[name], key, value)
        return model

    def whole_parameters(self) -> contextlib.AbstractContextManager:
        """A block in which every parameter of this rank's model is whole (``--dp-shard zero3``: all-gathered over
        the group, :meth:`labkit.parallel.zero_sharding.ZeroSharding.gathered`; collective); else nothing to do."""
        return self.zero.gathered() if self.zero is not None else contextlib.nullcontext()

    def state_key(self) -> dict:
        key = {"dp": self.size, "dp_shard": self.shard}  # fsdp and ZeRO shards do not load into replicas
        if self.sync != "every-step":
            key.update(sync=self.sync, sync_every=self.sync_every)
        return key

    def begin_step(self) -> None:
        """ZeRO: stage 1's flat gradients zeroed; the buffers (e.g. batch-norm statistics) follow the group's first
        rank, one broadcast each, as DDP's forward does (a model without buffers: no collective)."""
        if self.zero is not None:
            self.zero.begin_step()
            src = dist.get_global_rank(self.group, 0)
            with torch.no_grad():
                for b in self.buffers:
                    kdist.broadcast(b, src=src, group=self.group)

    def sync_gradients(self, model: nn.Module) -> None:
        if self.zero is not None:
            self.zero.sync_gradients()
            return
        if self.size == 1 or self.shard == "fsdp" or self.wraps_ddp:  # FSDP2, DDP: reduced during backward
            return
        if self.sync != "every-step":  # local SGD, DiLoCo: each replica steps on its own gradient
            return
        average_gradients(model.parameters(), self.algorithm, self.bucket_bytes, group=self.group)

    def build_optimizer(self, model: nn.Module, spec):
        """``spec``'s optimizer: over this rank's ZeRO shards (``--dp-shard zero*``), else over ``model``'s
        parameters (FSDP2's are shards of their own). Layer-wise optimizers are refused where a rank holds only
        part of each layer."""
        if self.zero is not None:
            refuse_layerwise(spec.name, self.label, HOLDS[self.shard])
            return self.zero.build_optimizer(spec)
        if self.shard == "fsdp":
            refuse_layerwise(spec.name, self.label, HOLDS[self.shard])
        if self.sync != "every-step" and (spec.name.startswith("kfac") or spec.name in ("shampoo", "soap", "muon")):
            raise ConfigError(f"--optimizer {spec.name} with --sync {self.sync}: it shares its work or its factors "
                              "over the ranks every step, but each replica steps alone between meetings; use sgd, "
                              "adam, lars or lamb (or --sync every-step)")
        built = spec.build(model.module if self.wraps_ddp else model)
        if self.sync != "every-step" and self.size > 1:
            self.periodic = build_sync(self.sync, model, self.group, self.size, self.sync_every, self.outer_lr,
                                       self.outer_momentum)
            self.periodic.attach(built[0])
        return built


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


class DataParallelPreset(MeshStrategy):
    """``--strategy ddp``, ``zero``, ``fsdp``: presets of ``--mesh dp=<world size>`` with one ``--dp-shard``
    (:meth:`shard_of` their own flags), every rank a data shard; the options pass to the dp dimension unchanged.

    Built before the job's process group exists (to look at its samplers), it has no mesh: its dp dimension reads
    its place on the grid, its flags are checked and its ranks still shard the data.
    """

    def __init__(self, env, options=None):
        options = dict(options or {})
        options.update(mesh=f"dp={env.world_size}", dp_shard=self.shard_of(options), preset=self.name)
        self.shard, self.allreduce, self.bucket_mb = read_options(options)
        if read_sync(options)[0] != "every-step":  # the replicas differ between meetings: each rank saves its own
            self.replicated = False
        super().__init__(env, options)

    def shard_of(self, options: dict) -> str:
        """The ``--dp-shard`` this preset means, given its flags."""
        return "none"

    @property
    def dp(self) -> DataParallel | None:
        """The mesh's dp dimension (None in one process)."""
        return self.dims[0] if self.dims else None

    @property
    def data_parallel_size(self) -> int:
        return self.env.world_size

    def data_shard(self) -> tuple[int, int]:
        return self.env.world_size, self.env.rank

    def sampler(self, dataset, train: bool, seed: int):
        # replicas and ZeRO 1-2 evaluate on whole parameters with no collective: shards without padding
        if train or self.shard in ("none", "zero1", "zero2"):
            return super(MeshStrategy, self).sampler(dataset, train, seed)
        return super().sampler(dataset, train, seed)

    def build_optimizer(self, model: nn.Module, spec):
        if self.dp is None and self.shard != "none":  # one process: refused as the dp dimension would refuse it
            refuse_layerwise(spec.name, self.name, HOLDS[self.shard])
        return super().build_optimizer(model, spec)

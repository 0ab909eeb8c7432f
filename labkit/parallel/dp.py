"""The ``dp`` dimension of a mesh: data parallelism over the mesh's ``dp`` groups.

    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --model gpt-tiny --dataset text-sample
    ... --mesh dp=2,tp=2 --dp-shard fsdp     # FSDP2 over dp, on top of tensor parallelism

Each ``dp`` group holds ``size`` copies of the same (tp-sharded, pp-cut) model, every copy its own shard
of each batch (the sampler shards by the rank's ``dp`` coordinate). The mean loss over the global batch is
the mean of the shards' means, so its gradient is the mean of theirs:

    ∇L = (1/dp) Σ_r ∇L_r

``--dp-shard none`` (default): the copies start equal (broadcast from the group's first rank) and the
gradients are averaged after backward by labkit's bucketed all-reduce (the ``--strategy ddp --allreduce
native`` path) over the ``dp`` group only: one all-reduce per 25 MB bucket per step, nothing else.
``--dp-shard fsdp``: FSDP2 ``fully_shard`` over ``mesh["dp"]``: every parameter — a tp shard already, when
``tp`` > 1, as torchtitan composes them — is split once more along dim 0 over the dp ranks, all-gathered for
forward and backward, its gradient reduce-scattered (averaged) during backward.
``--dp-shard zero3`` is refused: labkit's hand-written ZeRO (``--strategy zero``) shards over the whole job and
takes no process group; on a mesh use ``--dp-shard fsdp``, the same stage-3 sharding by PyTorch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import group as kdist
from labkit.errors import ConfigError
from labkit.parallel.base import Dimension
from labkit.parallel.data_parallel import DEFAULT_BUCKET_MB, average_gradients

#: ``labkit train --mesh ...`` flags of this dimension, plain data read without importing it (labkit.flags)
FLAGS = [
    {"flag": "--dp-shard", "default": "none", "choices": ["none", "zero3", "fsdp"],
     "help": "dp dimension: none = replicas + bucketed gradient all-reduce; fsdp = FSDP2 fully_shard over the dp "
             "groups; zero3 = refused on a mesh (use fsdp)"},
]
#: ``labkit advise --model gpt-*``'s mesh search (labkit.parallel.pricing): the pricing function below
ADVISOR = {"price": "labkit.parallel.dp:mesh_time"}


def price(param_bytes: float, size: int, shard: str = "none") -> dict[str, float]:
    """Bytes one rank sends per step over its ``dp`` group of ``d`` ranks, for ``P`` bytes of (this rank's)
    parameters, on ring collectives:

    * ``none``: one all-reduce of the gradients, ``2·(d − 1)/d·P``;
    * ``fsdp``: per step a reduce-scatter of the gradients and two all-gathers of the parameters (before
      forward, again before backward: FSDP2 reshards after forward), ``3·(d − 1)/d·P``.

    ``d = 1`` sends nothing.
    """
    collectives = {"none": 2, "fsdp": 3}[shard]
    return {"bytes": collectives * (size - 1) / size * param_bytes if size > 1 else 0.0}



class DataParallel(Dimension):
    """Replicas (or FSDP2 shards) of the model over the ``dp`` groups, gradients averaged over them."""

    name = "dp"

    def __init__(self, mesh, options):
        super().__init__(mesh, options)
        self.shard = self.options.get("dp_shard") or "none"
        self.averages_gradients = self.size > 1 and self.shard == "none"
        self.bucket_bytes = int(DEFAULT_BUCKET_MB * 2**20)

    @property
    def data_parallel_size(self) -> int:
        return self.size

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        if self.shard == "zero3":
            raise ConfigError("--dp-shard zero3: labkit's ZeRO shards over the whole job and takes no process group, "
                              "so it cannot be the dp dimension of a mesh; use --dp-shard fsdp (FSDP2, ZeRO stage 3)")

    def parallelize(self, model: nn.Module) -> nn.Module:
        if self.size == 1:
            return model
        # every copy starts from the group's first rank's (as DDP does; fully_shard keeps this rank's slice of
        # its own copy, so it too must start from one copy)
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                kdist.broadcast(tensor, src=src, group=self.group)
        return self._fully_shard(model) if self.shard == "fsdp" else model

    def _fully_shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        submesh = self.mesh["dp"]
        for module in _units(model):
            fully_shard(module, mesh=submesh)
        return fully_shard(model, mesh=submesh)

    def state_key(self) -> dict:
        return {"dp": self.size, "dp_shard": self.shard}  # fsdp shards do not load into replicas

    def sync_gradients(self, model: nn.Module) -> None:
        if self.size == 1 or self.shard == "fsdp":  # FSDP2 reduce-scattered them during backward
            return
        average_gradients(model.parameters(), "native", self.bucket_bytes, group=self.group)


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

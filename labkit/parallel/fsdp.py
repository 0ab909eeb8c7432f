"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): the production version of ZeRO stage 3.

    torchrun --nproc_per_node 4 -m labkit train --strategy fsdp --model resnet20 --dataset cifar10

Each module that owns parameters becomes an FSDP unit, then the whole model does: parameters are DTensors
sharded along dim 0 over the ranks (``Shard(0)``), all-gathered before a unit's forward and backward and
resharded after; gradients are reduce-scattered and averaged; the optimizer steps each rank's shards.
``--fsdp-no-reshard`` keeps the gathered parameters from forward to backward (ZeRO-2-like: less traffic,
more memory). Works on CPU with gloo and on GPUs with NCCL; this file needs no CUDA-only feature
(mixed precision and CPU offload, which would, are not used).

A preset of ``--mesh dp=N --dp-shard fsdp`` over every rank of the job (:mod:`labkit.parallel.dp`).
Checkpoints: the mesh's; each rank writes ``checkpoint.rank{r}.pt`` holding its local shards of parameters and
optimizer state as plain tensors (``weights_only`` loading), rebuilt into DTensors on load.
K-FAC, LARS and LAMB are refused, as with ZeRO: they need whole layers on one rank.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from labkit.errors import ConfigError
from labkit.parallel.dp import DataParallelPreset

#: ``labkit train --strategy fsdp`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--fsdp-no-reshard", "action": "store_true",
     "help": "keep each unit's gathered parameters from forward to backward (fewer all-gathers, more memory)"},
]
#: ``labkit advise``: ``p`` ranks each on ``B/p`` samples, resharding or not (labkit.advisor.search)
ADVISOR = {"price": "labkit.parallel.zero:price_sharded", "plans": "spread", "batch": "split",
           "grid": {"fsdp_no_reshard": [False, True]}}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 2, "flags": []}


class FSDPStrategy(DataParallelPreset):
    """``--strategy fsdp``: ``fully_shard`` on every parameter-owning module, then on the model, over every rank
    (the dp dimension's ``--dp-shard fsdp``)."""

    name = "fsdp"

    def shard_of(self, options: dict) -> str:
        return "fsdp"

    def __init__(self, env, options=None):
        if not env.distributed:
            raise ConfigError("--strategy fsdp needs a process group: start it with torchrun (or srun), even "
                              "with one rank, e.g. torchrun --nproc_per_node 2 -m labkit train --strategy fsdp")
        super().__init__(env, options)
        self.reshard = not self.options.get("fsdp_no_reshard")

    def memory_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of this rank's shards: ``{"params", "grads", "optimizer"}`` (0-d step counters excluded)."""
        def nbytes(t) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()
        params = [p for p in model.parameters()]
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
        return {"params": sum(map(nbytes, params)), "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(map(nbytes, state))}

    def full_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        """Every parameter, whole, on every rank (all-gathered): for tests and notebooks."""
        return [p.full_tensor().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
                for p in model.parameters()]

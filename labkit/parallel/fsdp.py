"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): the production version of ZeRO stage 3.

    torchrun --nproc_per_node 4 -m labkit train --strategy fsdp --model resnet20 --dataset cifar10

Each module that owns parameters becomes an FSDP unit, then the whole model does: parameters are DTensors
sharded along dim 0 over the ranks (``Shard(0)``), all-gathered before a unit's forward and backward and
resharded after; gradients are reduce-scattered and averaged; the optimizer steps each rank's shards.
``--fsdp-no-reshard`` keeps the gathered parameters from forward to backward (ZeRO-2-like: less traffic,
more memory). Works on CPU with gloo and on GPUs with NCCL; this file needs no CUDA-only feature
(mixed precision and CPU offload, which would, are not used).

Checkpoints: each rank writes ``checkpoint.rank{r}.pt`` holding its local shards of parameters and
optimizer state as plain tensors (``weights_only`` loading), rebuilt into DTensors on load.
K-FAC, LARS and LAMB are refused, as with ZeRO: they need whole layers on one rank.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from labkit.errors import CheckpointError, ConfigError
from labkit.parallel.data_parallel import DataParallelStrategy, broadcast_from_rank0
from labkit.parallel.zero import refuse_layerwise

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


def _local(value):
    """A DTensor's local shard as a plain tensor (checkpoints hold no DTensors)."""
    return value.to_local().detach().clone() if isinstance(value, DTensor) else value


class FSDPStrategy(DataParallelStrategy):
    """``fully_shard`` on every parameter-owning module, then on the model."""

    name = "fsdp"
    replicated = False

    def __init__(self, env, options=None):
        super().__init__(env, options)
        if not env.distributed:
            raise ConfigError("--strategy fsdp needs a process group: start it with torchrun (or srun), even "
                              "with one rank, e.g. torchrun --nproc_per_node 2 -m labkit train --strategy fsdp")
        self.reshard = not self.options.get("fsdp_no_reshard")

    def prepare(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.to(self.env.device)
        broadcast_from_rank0(model)  # fully_shard keeps each rank's slice of its own copy: start from one copy
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
        owners = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
        for module in owners:
            fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard)

    def sampler(self, dataset, train: bool, seed: int):
        # evaluation: every forward all-gathers, so every rank must run the same batches (rank 0 counts them)
        return super().sampler(dataset, train, seed) if train else None

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        out = model(x)
        return out if self.env.is_main else None

    def build_optimizer(self, model: nn.Module, spec):
        refuse_layerwise(spec.name, "fsdp", "a shard of each tensor")
        return spec.build(model)

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
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return {**local_state(model, optimizer), "world_size": self.env.world_size}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if state.get("world_size") != self.env.world_size:
            raise CheckpointError(f"the FSDP shards were written by {state.get('world_size')} ranks but this job has "
                                  f"{self.env.world_size}; resume with the same number of ranks")
        load_local_state(model, optimizer, state)


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"model", "optimizer"}`` with every DTensor replaced by this rank's local shard (plain tensors)."""
    opt = optimizer.state_dict()
    opt["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in opt["state"].items()}
    return {"model": {k: _local(v) for k, v in model.state_dict().items()}, "optimizer": opt}


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load what :func:`local_state` saved, rebuilding DTensors around the local shards.

    Raises:
        CheckpointError: other parameter names, another shard shape, or optimizer state that does not fit.
    """
    current = model.state_dict()
    if current.keys() != state["model"].keys():
        raise CheckpointError("the checkpoint's parameters do not match this model")
    like = {}
    for name, saved in state["model"].items():
        ref = current[name]
        if isinstance(ref, DTensor):
            if saved.shape != ref.to_local().shape:
                raise CheckpointError(f"shard {name} has shape {tuple(saved.shape)}, this rank holds "
                                      f"{tuple(ref.to_local().shape)}")
            saved = DTensor.from_local(saved, ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride())
        elif isinstance(ref, torch.Tensor) and saved.shape != ref.shape:
            raise CheckpointError(f"{name} has shape {tuple(saved.shape)}, this rank holds {tuple(ref.shape)}")
        like[name] = saved
    model.load_state_dict(like)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    opt = dict(state["optimizer"])
    opt["state"] = {i: {k: (DTensor.from_local(v, params[i].device_mesh, params[i].placements,
                                               shape=params[i].shape, stride=params[i].stride())
                            if isinstance(v, torch.Tensor) and v.dim() and isinstance(params[i], DTensor) else v)
                        for k, v in s.items()} for i, s in opt["state"].items()}
    try:
        optimizer.load_state_dict(opt)
    except (ValueError, KeyError, IndexError) as exc:
        raise CheckpointError(f"the optimizer state does not fit: {exc}") from None

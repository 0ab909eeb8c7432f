"""Checkpoints that reshard: a run saved on one mesh resumes on another, and any run exports one whole file.

    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --model gpt-tiny --dataset text-sample --out runs/g
    torchrun --nproc_per_node 2 -m labkit train --mesh tp=2 ... --out runs/g --resume     # the same run, 2 ranks
    labkit train --model gpt-tiny --dataset text-sample --out runs/g --resume              # one process
    labkit export runs/g model.pt        # one file: torch.load("model.pt")["model"] is the whole state_dict

The layout is labkit's own, kept beside the files it already writes (one per rank, or ``checkpoint.pt``): each
file adds ``layout``, how its tensors cut the whole model (``{name: [dim, part, parts, whole shape]}`` for a
tensor-parallel shard, :meth:`labkit.strategies.base.Strategy.shard_layout`; a name not listed is whole), and
``param_names``, the name of each optimizer state index. Resharding is then plain tensor work on any number of
processes: every rank reads every file, joins the parts of each tensor along their dimension
(:func:`whole_state`, in part order) and cuts its own part for the new mesh with the same rule the tensor-parallel
layers cut by (:func:`labkit.parallel.mappings.part`, ``torch.tensor_split``'s parts); an optimizer state of a
parameter's shape (momentum, Adam's moments) is cut like the parameter, anything else (Adam's step) copied.
``torch.distributed.checkpoint`` does the same for DTensors, but labkit's tensor-parallel layers hold plain tensors
(rank r's rows or columns, uneven parts allowed), so naming each part's dimension is all a reshard needs, and the
files stay readable with ``torch.load`` in one process.

What a reshard cannot do is refused in one line naming the mesh that wrote it: a pipeline split (another split
moves the stage boundaries, and the stages' optimizer states with them), ZeRO or FSDP shards (flat buffers and
DTensor shards), expert parallelism, DiLoCo (its global parameters and outer momentum) and local SGD saved between
two meetings of the replicas (they differ).

The data position: every rank count reads one global sample order (:func:`labkit.data.loader.global_order`), so
step ``s`` of an epoch is the same global batch on any mesh with the same global batch; the metric sums of the
epoch so far go to the new rank 0, and a rank the old job did not have takes rank 0's random state (dropout masks
after a reshard are the new mesh's own, so equality holds without dropout).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from labkit.errors import CheckpointError
from labkit.parallel.mappings import part


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of ``optimizer``'s parameters, in its state's index order (a shared parameter: its first
    name)."""
    names = {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return [names.get(id(p), "") for group in optimizer.param_groups for p in group["params"]]


def _setup(state: dict) -> str:
    """How a checkpoint's writer is named in a refusal: ``--mesh dp=2,tp=2`` or ``N rank(s)``."""
    mesh = state.get("mesh")
    if isinstance(mesh, dict):
        from labkit.parallel.mesh import describe

        return f"--mesh {describe(mesh)}"
    return f"{state.get('world_size', 1)} rank(s)"


def _key_of(strategy) -> dict:
    return {"mesh": strategy.mesh_key() if hasattr(strategy, "mesh_key") else None,
            "world_size": strategy.env.world_size}


def check(states: list[dict], folder: Path, strategy=None) -> None:
    """Refuse in one line where the files of one checkpoint (``states``, read from ``folder``) come from different
    saves, or their writer's layout cannot be resharded (naming ``strategy``'s setup, the run offered it; None:
    ``labkit export``, which joins the parts)."""
    first = states[0]
    where = {(s.get("epoch"), (s.get("position") or {}).get("step", 0)) for s in states}
    if len(where) > 1:
        raise CheckpointError(f"the checkpoint files in {folder} come from different saves "
                              f"({sorted(where)}); delete the stale ones or run without --resume")
    why = next((s.get("layout_refusal") or "it has no layout (written by an older labkit)" for s in states
                if s.get("layout") is None), None)
    if why is not None and strategy is None:
        raise CheckpointError(f"it was written on {_setup(first)}; {why}, so its parts cannot be joined into one "
                              "model")
    if why is not None:
        raise CheckpointError(f"it was written on {_setup(first)} but this run has {_setup(_key_of(strategy))}; "
                              f"{why}: resume with {_setup(first)} or start without --resume")

def whole_state(states: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """``(model, optimizer)``: every tensor of the model whole, by name, and every parameter's optimizer state by
    name, its parameter-shaped tensors whole; the parts of a tensor-parallel shard joined in part order."""
    model, opt, pieces = {}, {}, {}
    for s in states:
        layout = s["layout"]
        for name, t in s["model"].items():
            if name in layout:
                dim, index, parts, shape = layout[name]
                pieces.setdefault(name, (dim, parts, shape, {}))[3].setdefault(index, t)
            else:
                model.setdefault(name, t)
        names = s["param_names"]
        for i, st in s["optimizer"]["state"].items():
            name = names[int(i)]
            for key, v in st.items():
                if name in layout and isinstance(v, torch.Tensor) and v.shape == s["model"][name].shape:
                    dim, index, parts, shape = layout[name]
                    pieces.setdefault((name, key), (dim, parts, shape, {}))[3].setdefault(index, v)
                else:
                    opt.setdefault(name, {}).setdefault(key, v)
    for key, (dim, parts, shape, got) in pieces.items():
        if sorted(got) != list(range(parts)):
            raise CheckpointError(f"the checkpoint holds parts {sorted(got)} of {key}, not all {parts}; its files "
                                  "are incomplete")
        joined = torch.cat([got[i] for i in range(parts)], dim)
        if list(joined.shape) != list(shape):
            raise CheckpointError(f"the parts of {key} join to {tuple(joined.shape)}, not {tuple(shape)}")
        if isinstance(key, tuple):
            opt.setdefault(key[0], {})[key[1]] = joined
        else:
            model[key] = joined
    return model, opt


def cut(whole: torch.Tensor, spec: list | None) -> torch.Tensor:
    """This rank's part of ``whole`` by its layout entry ``[dim, part, parts, shape]`` (None: all of it)."""
    if spec is None:
        return whole
    dim, index, parts, _ = spec
    start, stop = part(whole.shape[dim], parts, index)
    return whole.narrow(dim, start, stop - start).clone()


def resharded(states: list[dict], strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The checkpoint whose files hold ``states`` (checked by :func:`check`) cut for this rank of ``strategy``
    (what its ``load_state_dict`` takes).

    Raises:
        CheckpointError: in one line, where the tensors do not fit.
    """
    first = states[0]
    if first.get("preconditioner") is not None:
        raise CheckpointError(f"it was written on {_setup(first)} with K-FAC, whose factors are kept per rank: "
                              f"resume with {_setup(first)} or start without --resume")
    whole, opt = whole_state(states)
    module = strategy.unwrap(model)
    target = strategy.shard_layout(model)
    source = _saved_names(module, whole, first.get("flat_names") or {})
    local = {}
    for name, ref in module.state_dict().items():
        if source(name) not in whole:
            raise CheckpointError(f"it was written on {_setup(first)} and holds no {name}; is it this model?")
        local[name] = cut(whole[source(name)], target.get(name))
        if local[name].shape != ref.shape:
            raise CheckpointError(f"{name} is {tuple(whole[name].shape)} there, this run's is {tuple(ref.shape)} on "
                                  "this rank")
    saved_groups = first["optimizer"]["param_groups"]
    sd = optimizer.state_dict()
    if len(saved_groups) != len(sd["param_groups"]):
        raise CheckpointError(f"its optimizer has {len(saved_groups)} parameter groups, this run's "
                              f"{len(sd['param_groups'])}; resume with the same --optimizer")
    for mine, saved in zip(sd["param_groups"], saved_groups, strict=True):
        mine.update({k: v for k, v in saved.items() if k != "params"})
    sd["state"] = {}
    for i, name in enumerate(param_names(module, optimizer)):
        saved = source(name)
        if saved in opt:
            sd["state"][i] = {k: cut(v, target.get(name)) if isinstance(v, torch.Tensor)
                              and v.shape == whole[saved].shape else v for k, v in opt[saved].items()}
    state = {**first, "model": local, "optimizer": sd, "world_size": strategy.env.world_size,
             "position": _position(first.get("position"), strategy.env.world_size), "resharded_from": _setup(first)}
    if hasattr(strategy, "mesh_key"):
        state["mesh"] = strategy.mesh_key()
    return state


def flat_names(module: nn.Module) -> dict[str, str]:
    """``{name: name in the flat form}`` of each tensor of a CNN/MLP built nested (``labkit train --model mlp``):
    tensor and pipeline parallelism build the same model as the flat ``nn.Sequential`` of its layers
    (:func:`labkit.models.cnn.to_sequential`, sharing its tensors), which names them by layer (``fc1.weight`` for
    ``linear_relu_stack.fc1.weight``). Empty for a model that is flat already or has no flat form (the GPT: one set of
    names on every mesh)."""
    from labkit.errors import ConfigError
    from labkit.models.cnn import to_sequential

    if isinstance(module, nn.Sequential):
        return {}
    try:
        flat = to_sequential(module)
    except ConfigError:
        return {}
    by_tensor = {id(t): name for name, t in flat.state_dict(keep_vars=True).items()}
    return {name: by_tensor[id(t)] for name, t in module.state_dict(keep_vars=True).items() if id(t) in by_tensor}


def _saved_names(module: nn.Module, whole: dict, saved_flat: dict[str, str]):
    """``name -> the name the checkpoint holds it under``: the same, or across the flat and the nested form of one
    CNN/MLP (this model nested and the checkpoint flat, or the other way: the writer's ``flat_names``)."""
    names = list(module.state_dict())
    if all(n in whole for n in names):
        return lambda n: n
    mine = flat_names(module)
    if mine and all(mine.get(n) in whole for n in names):
        return lambda n: mine[n]
    nested = {flat: name for name, flat in saved_flat.items()}
    if nested and all(nested.get(n) in whole for n in names):
        return lambda n: nested[n]
    return lambda n: n


def _position(position: dict | None, world: int) -> dict | None:
    """A mid-epoch position for ``world`` ranks: the same step; the epoch's metric sums so far on rank 0 (every
    rank's are summed at the epoch's end); each rank its old random state, a new rank rank 0's."""
    if position is None:
        return None
    totals = torch.stack(position["totals"]).sum(0)
    old = len(position["rng"])
    return {"step": position["step"],
            "totals": [totals if r == 0 else torch.zeros_like(totals) for r in range(world)],
            "rng": [position["rng"][r if r < old else 0] for r in range(world)],
            "cuda_rng": [position["cuda_rng"][r if r < old else 0] for r in range(world)]}

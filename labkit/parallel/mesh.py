"""``--mesh dp=2,tp=2``: the ranks laid out on a named device mesh, one :mod:`labkit.parallel` dimension per axis.

    torchrun --nproc_per_node 2 -m labkit train --mesh dp=2 --model lenet --dataset mnist-sample
    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --model gpt-tiny --dataset text-sample
    torchrun --nproc_per_node 8 -m labkit train --mesh dp=2,tp=2,pp=2 --model gpt-tiny --dataset text-sample

The strategy holds the mesh (:func:`labkit.dist.mesh.build_mesh`) and the dimensions of size > 1, in the apply
order of :data:`labkit.parallel.DIMENSIONS` (tp, cp, ep, pp, dp), and runs each step as
:mod:`labkit.parallel.base` describes: shard the batch, forward (or pp's schedule), the dimensions' loss,
backward, the gradient synchronisations in reverse order. It adds no collective of its own to a step.

Checkpoints: every rank writes ``checkpoint.rank{r}.pt`` (its shards, plain tensors) with the mesh shape;
``--resume`` on another mesh is refused with one line.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from labkit.dist.mesh import MESH_ORDER, MeshPlace, MeshShape, build_mesh
from labkit.errors import CheckpointError
from labkit.models.names import LANGUAGE_MODELS
from labkit.parallel import DIMENSIONS, get_dimension
from labkit.parallel.data_parallel import DEFAULT_BUCKET_MB, DataParallelStrategy, ShardSampler, average_gradients

#: ``labkit train`` flags, plain data read without importing this module (labkit.flags); each dimension's
#: own flags (``labkit.parallel.<name>.FLAGS``) come with them
FLAGS = [
    {"flag": "--mesh", "default": None, "metavar": "DIM=N,...",
     "help": "the device mesh, e.g. dp=2,tp=2 (dimensions pp, dp, ep, cp, tp; their product = the number of "
             "ranks; None: dp over every rank)"},
]
#: every mesh dimension's flags are this strategy's too (labkit.strategies.strategy_flags)
DIMENSION_FLAGS = True
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run (the CNN on a dp mesh)
BENCH = {"ranks": 2, "flags": ["--mesh", "dp=2"]}
#: backend/device combinations refused before any work (labkit.strategies.backends); gloo's send/recv take CPU tensors only
#: (on CUDA ones it fails in its transport: "writev ... Bad address")
BACKENDS = [
    {"dims": ["pp"], "backend": "gloo", "device": "cuda",
     "why": "--mesh {mesh}: the pipeline's stages send activations point to point, which gloo does on CPU tensors "
            "only; use --backend nccl (one GPU per rank), or --device cpu (or leave --device auto)"},
]


class PaddedShardSampler(ShardSampler):
    """Evaluation shard ``r, r + W, r + 2W, ...`` padded to ``ceil(N / W)`` indices on every rank.

    A mesh's evaluation forward has collectives (tp, cp, ep, pp), so every data-parallel rank must run the same
    number of batches: a rank with one batch fewer would leave the others waiting in a collective forever. The
    padding repeats the shard's first index (index 0 for an empty shard); :func:`labkit.train.loop.evaluate` counts only
    the first ``real`` samples, so every test sample is counted exactly once over the ranks.
    """

    def __init__(self, dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas, rank)
        self.real = super().__len__()
        self.padded = -(-self.size // num_replicas)

    def __iter__(self):
        shard = list(super().__iter__())
        return iter(shard + [shard[0] if shard else 0] * (self.padded - self.real))

    def __len__(self) -> int:
        return self.padded


class MeshStrategy(DataParallelStrategy):
    """The dimensions of ``--mesh`` stacked on one model.

    Attributes:
        shape: every mesh dimension's size, in :data:`labkit.dist.mesh.MESH_ORDER` (sizes of 1 included).
        mesh: the DeviceMesh (``None`` in a single process without a process group).
        dims: the dimensions of size > 1, in apply order.
    """

    name = "mesh"
    replicated = False

    def __init__(self, env, options=None):
        super().__init__(env, options)
        self.shape = MeshShape.parse(self.options.get("mesh") or f"dp={env.world_size}")
        self.shape.check_world(env.world_size)
        self.options["mesh"] = str(self.shape)
        classes = [get_dimension(n) for n in DIMENSIONS if self.shape[n] > 1]  # unavailable: ConfigError now
        # without a process group (options and the model checked, the stages cut, the samplers made, before any
        # communication) each dimension reads this rank's place on the mesh's grid
        self.mesh = build_mesh(self.shape, env.device.type) if env.distributed and dist.is_initialized() else None
        place = self.mesh if self.mesh is not None else MeshPlace(self.shape, env.rank, env.device.type)
        self.dims = [cls(place, self.options) for cls in classes]
        self.pipeline = next((d for d in self.dims if d.name == "pp"), None)
        # the dimensions that average gradients, when two or more: one all-reduce over their flattened group
        self.averaged = [d for d in self.dims if d.averages_gradients]
        self.averaged = self.averaged if len(self.averaged) > 1 else []
        self.averaged_group = None
        if self.averaged:  # collective: every rank flattens the same dimensions (torchtitan's way to a "dp_cp" group)
            names = tuple(n for n in MESH_ORDER if n in {d.name for d in self.averaged})
            self.averaged_group = self.mesh[names]._flatten("_".join(names)).get_group()
        self.sequential_model = False  # check_model: a CNN on a pipeline is built as a flat nn.Sequential
        self._criteria: dict[int, nn.Module] = {}

    def check_model(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        """Every dimension's :meth:`~labkit.parallel.base.Dimension.check` (ConfigError before any work)."""
        for d in self.dims:
            d.check(model_name, seq_len, dropout)
        # pp cuts a GPT by its layer names and tp splits its blocks; any other model they cut or split as the flat
        # nn.Sequential it is then built as
        self.sequential_model = model_name not in LANGUAGE_MODELS and any(d.name in ("pp", "tp") for d in self.dims)

    def check_batch(self, batch_size: int) -> None:
        """Every dimension's :meth:`~labkit.parallel.base.Dimension.check_batch`."""
        for d in self.dims:
            d.check_batch(batch_size)

    # ----- data: shards by the data-parallel coordinates ----------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        return math.prod(d.data_parallel_size for d in self.dims)

    def data_shard(self) -> tuple[int, int]:
        """``(shards, this rank's shard)``: mixed radix over the data-parallel dimensions in mesh order, so the
        ranks of one tp (pp, ...) group read the same samples."""
        index = 0
        for name in MESH_ORDER:
            d = next((d for d in self.dims if d.name == name), None)
            if d is not None and d.data_parallel_size > 1:
                index = index * d.data_parallel_size + d.rank
        return self.data_parallel_size, index

    def sampler(self, dataset, train: bool, seed: int):
        world, index = self.data_shard()
        if train or world == 1:
            return super().sampler(dataset, train, seed)
        return PaddedShardSampler(dataset, world, index)

    # ----- the model and the step ---------------------------------------------------------------------

    def prepare(self, model: nn.Module) -> nn.Module:
        model = model.to(self.env.device)
        for d in self.dims:
            model = d.parallelize(model)
        return model

    def _criterion(self, criterion: nn.Module) -> nn.Module:
        key = id(criterion)
        if key not in self._criteria:  # built once: a step creates no module
            for d in self.dims:
                criterion = d.criterion(criterion)
            self._criteria[key] = criterion
        return self._criteria[key]

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, criterion: nn.Module):
        for d in self.dims:
            d.begin_step()
        for d in self.dims:
            x, y = d.shard_batch(x, y)
        criterion = self._criterion(criterion)
        if self.pipeline is not None:
            return self.pipeline.forward_backward(model, x, y, criterion)
        out = model(x)  # (B, classes) or (B, T, vocab / tp)
        loss = criterion(out, y)
        loss.backward()
        return loss.detach(), out.detach()

    def sync_gradients(self, model: nn.Module) -> None:
        """Every dimension's synchronisation in reverse apply order; the averaging dimensions (dp, cp, ep), when
        two or more, together in :meth:`_average_once` (averages over different groups commute with the other
        dimensions' sums, so the order does not change the result); a dimension with ``sync_last`` (dp under
        ZeRO) after all the others."""
        if self.averaged:
            self._average_once(model)
        ordered = [d for d in reversed(self.dims) if not d.sync_last] + [d for d in self.dims if d.sync_last]
        for d in ordered:
            if d not in self.averaged:
                d.sync_gradients(model)

    def _average_once(self, model: nn.Module) -> None:
        """Gradients averaged over the flattened group of the averaging dimensions in one bucketed all-reduce
        (what one data-parallel group of their product would do). Under ep the experts are not replicated over
        it: an expert's gradient already sums the ep ranks' losses (their rows came to it), so it is averaged
        over dp alone (a second all-reduce, of the experts only, as a plain expert-parallel step has) and
        divided by ep."""
        from labkit.parallel.ep import expert_params

        names = {d.name: d for d in self.averaged}
        experts = expert_params(model) if "ep" in names else set()
        params = [p for p in model.parameters() if p.requires_grad]
        bucket = int(DEFAULT_BUCKET_MB * 2**20)
        algorithm = names["dp"].algorithm if "dp" in names else "native"  # dp's --allreduce
        average_gradients([p for p in params if id(p) not in experts], algorithm, bucket, group=self.averaged_group)
        if experts:
            ours = [p for p in params if id(p) in experts]
            if "dp" in names:
                average_gradients(ours, algorithm, bucket, group=names["dp"].group)
            for p in ours:
                if p.grad is not None:
                    p.grad /= names["ep"].size

    def close(self) -> None:
        """Every dimension's :meth:`~labkit.parallel.base.Dimension.close` (pp writes its timeline)."""
        for d in self.dims:
            d.close()

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """Evaluation: the whole output on the ranks that own it (pp: its schedule's forward)."""
        out = self.pipeline.forward(model, x) if self.pipeline is not None else self.unwrap(model)(x)
        if out is None:
            return None
        for d in self.dims:
            out = d.full_output(out)
        return out

    def seed_rank(self, rank: int) -> int:
        """The first rank of this rank's tp group (tp is innermost: its ranks are neighbours), so the replicated
        dropouts of a tp group draw the same masks (:mod:`labkit.parallel.tp_rng`); dp, pp, ... differ as before."""
        tp = next((d for d in self.dims if d.name == "tp"), None)
        return rank if tp is None else rank - tp.rank

    def metric_owner(self) -> bool:
        return all(d.owns_metrics() for d in self.dims)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model inside dp's DistributedDataParallel (evaluation runs it bare: no buffer broadcast)."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def build_optimizer(self, model: nn.Module, spec):
        """The dp dimension's (:meth:`labkit.parallel.dp.DataParallel.build_optimizer`: over its ZeRO shards, if
        any), else ``spec``'s over the model's parameters."""
        dp = next((d for d in self.dims if d.name == "dp"), None)
        return dp.build_optimizer(model, spec) if dp is not None else spec.build(model)

    # ----- checkpoints: one file per rank, with the mesh ---------------------------------------------

    def mesh_key(self) -> dict:
        """What a checkpoint must match: every dimension's ``state_key`` (and the full shape)."""
        key = dict(self.shape)
        for d in self.dims:
            key.update(d.state_key())
        return key

    def whole_parameters(self) -> contextlib.AbstractContextManager:
        """A block in which this rank's parameters (its tp/pp part) are whole: under ``--dp-shard zero3``
        all-gathered over dp (collective), freed after (:meth:`labkit.parallel.dp.DataParallel.whole_parameters`)."""
        dp = next((d for d in self.dims if d.name == "dp"), None)
        return dp.whole_parameters() if dp is not None else contextlib.nullcontext()

    def reshard_refusal(self) -> str | None:
        """Why this mesh's checkpoint resumes only on this mesh (:mod:`labkit.train.reshard`), or None: a pipeline
        (another split moves the stage boundaries), expert parallelism (experts live on their ranks), ZeRO/FSDP
        shards (flat buffers, DTensors), DiLoCo (its global parameters and outer momentum), local SGD between two
        meetings (the replicas differ)."""
        for name, why in (("pp", "a pipeline split does not reshard (another split moves the stage boundaries)"),
                          ("ep", "expert parallelism does not reshard (the experts live on their ep ranks)")):
            if self.shape[name] > 1:
                return why
        dp = next((d for d in self.dims if d.name == "dp"), None)
        if dp is not None and dp.shard != "none":
            return f"--dp-shard {dp.shard} does not reshard (a rank holds {dp.holds})"
        periodic = self._periodic()
        if dp is not None and dp.sync == "diloco":
            return "DiLoCo does not reshard (its global parameters and outer momentum)"
        if periodic is not None and not periodic.at_meeting():
            return "local SGD saved between two meetings does not reshard (the replicas differ)"
        return None

    def shard_layout(self, model: nn.Module) -> dict:
        """Each tensor-parallel shard of this rank: ``[dim, tp rank, tp size, whole shape]`` by name (the whole
        shapes recorded by :meth:`labkit.parallel.tp.TensorParallel.parallelize` before it cut them)."""
        tp = next((d for d in self.dims if d.name == "tp"), None)
        if tp is None:
            return {}
        found = {}
        for name, t in self.unwrap(model).state_dict().items():
            whole = tp.whole_shapes.get(name)
            if whole is not None and tuple(t.shape) != whole:
                dim = next(i for i, (a, b) in enumerate(zip(t.shape, whole, strict=True)) if a != b)
                found[name] = [dim, tp.rank, tp.size, list(whole)]
        return found

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        with self.whole_parameters():
            state = local_state(self.unwrap(model), optimizer)
            state["model"] = {k: v.clone() for k, v in state["model"].items()}  # ZeRO-3 frees them after the block
        periodic = self._periodic()
        if periodic is not None:  # --sync local-sgd|diloco: the step count (and DiLoCo's θ and outer momentum)
            state["sync"] = periodic.state_dict()
        return {**state, "world_size": self.env.world_size, "mesh": self.mesh_key()}

    def _periodic(self):
        """The dp dimension's meetings every H steps (``--sync local-sgd|diloco``), or None."""
        dp = next((d for d in self.dims if d.name == "dp"), None)
        return getattr(dp, "periodic", None)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        saved = state.get("mesh")
        if saved != self.mesh_key():
            written = describe(saved) if isinstance(saved, dict) else "no mesh"
            why = self.reshard_refusal() or state.get("layout_refusal")
            raise CheckpointError(f"it was written on --mesh {written} but this run has --mesh "
                                  f"{describe(self.mesh_key())}; {why + ': ' if why else ''}resume with --mesh "
                                  f"{written} or start without --resume")
        with self.whole_parameters():
            load_local_state(self.unwrap(model), optimizer, state)
        if self._periodic() is not None and state.get("sync") is not None:
            self._periodic().load_state_dict(state["sync"])


def describe(key: dict) -> str:
    """``{"dp": 2, "dp_shard": "fsdp", "tp": 1, ...}`` -> ``"dp=2 --dp-shard fsdp"`` (options at their default
    ``none``/``False`` left out)."""
    options = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in key.items()
               if k not in MESH_ORDER and v not in (None, False, "none")]
    return " ".join([str(MeshShape({n: key.get(n, 1) for n in MESH_ORDER})), *options])


def _local(value):
    """A DTensor's local shard as a plain tensor (checkpoints hold no DTensors)."""
    return value.to_local().detach().clone() if isinstance(value, DTensor) else value


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

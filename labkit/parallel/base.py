"""The dimension interface: what one axis of the device mesh does to the model, the batch and the gradients.

:class:`labkit.parallel.mesh.MeshStrategy` holds one :class:`Dimension` per mesh name and calls, in
the APPLY order of :data:`labkit.parallel.DIMENSIONS` (``tp, cp, ep, pp, dp``)::

    for d in dims: d.check(model_name)                 # before any work: ConfigError -> one line, exit 2
    for d in dims: model = d.parallelize(model)        # tp shards layers, cp/ep swap attention/experts,
                                                       # pp cuts stages, dp wraps what is left
    per step:
        for d in dims: d.begin_step()                  # dp under ZeRO: stage 1's flat gradients zeroed, buffers broadcast
        for d in dims: x, y = d.shard_batch(x, y)      # this rank's part of the batch
        for d in dims: criterion = d.criterion(criterion)
        loss = criterion(model(x), y); loss.backward() # or pp's forward_backward(model, x, y, criterion)
        for d in reversed(dims): d.sync_gradients(model)   # (a dimension with sync_last: after the others)

Losses: every dimension sees the mean loss over its own tokens; averaging gradients over the data-like
groups (dp, cp) makes the step equal to one step of single-process ``fit`` on the global batch.
A dimension of size 1 changes nothing. Its ``labkit train`` flags are the ``FLAGS`` literal of its module
(:mod:`labkit.flags`); the parsed values arrive as ``options``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.errors import ConfigError
from labkit.models.names import LANGUAGE_MODELS

#: the mixture-of-experts GPTs (``labkit.models.moe.MOE_SIZES``; only ``ep`` spreads them, dp replicates them)
MOE_MODELS = frozenset(n for n in LANGUAGE_MODELS if n.startswith("gpt-moe"))


def refuse_moe(name: str, size: int, model_name: str, why: str) -> None:
    """One line (ConfigError) if ``model_name`` is a mixture of experts and dimension ``name`` of ``size`` > 1
    cannot carry it; ``why`` says what would go wrong."""
    if size > 1 and model_name in MOE_MODELS:
        raise ConfigError(f"--mesh {name}={size} with --model {model_name} is not supported: {why}; spread the "
                          "experts with ep and the batch with dp (e.g. --mesh dp=2,ep=2)")


class Dimension:
    """One named axis of the device mesh.

    Args:
        mesh: the job's whole mesh (all of ``labkit.dist.mesh.MESH_ORDER``, sizes of 1 included).
        options: every parsed ``labkit train`` option, by ``dest`` name (each dimension reads its own).

    Attributes:
        mesh, options: as given.
        group: this dimension's process group, ``mesh.get_group(name)``.
        size: ranks along this dimension.
        rank: this rank's coordinate along it, ``mesh.get_local_rank(name)``.
    """

    name: str = ""
    #: distinct batch shards this dimension makes (dp: its size; tp, pp: 1)
    data_parallel_size: int = 1
    #: does ``sync_gradients`` average the (non-expert) gradients over this dimension's group (dp with replicas,
    #: cp, ep)? Two or more such dimensions average once over their flattened group instead
    #: (:meth:`labkit.parallel.mesh.MeshStrategy.sync_gradients`): one all-reduce, not one per dimension.
    averages_gradients: bool = False
    #: must ``sync_gradients`` run after every other dimension's (dp under ZeRO: it takes the gradients off the
    #: parameters, so the others' sums and averages must be done on them first)?
    sync_last: bool = False

    def __init__(self, mesh: DeviceMesh, options: dict):
        self.mesh = mesh
        self.options = dict(options or {})
        self.group = mesh.get_group(self.name)
        self.size = mesh.size(mesh.mesh_dim_names.index(self.name))
        self.rank = mesh.get_local_rank(self.name)

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        """Raise :class:`~labkit.errors.ConfigError` if this dimension cannot apply to ``model_name`` built with
        ``seq_len`` tokens per example and ``dropout`` (e.g. "tp needs --model gpt*"). Called before any work
        starts: before the data is loaded and the model built."""

    def check_batch(self, batch_size: int) -> None:
        """Raise :class:`~labkit.errors.ConfigError` if this dimension cannot step on batches of ``batch_size``
        samples per rank; called with :meth:`check`, before any work."""

    def parallelize(self, model: nn.Module) -> nn.Module:
        """This dimension's change to ``model`` (in APPLY order); size 1: ``model`` unchanged."""
        return model

    def begin_step(self) -> None:
        """Before a training step's forward (no host sync; dp under ZeRO broadcasts the buffers); default nothing."""

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the batch (cp: its sequence chunks); default: all of it."""
        return x, y

    def criterion(self, criterion: nn.Module) -> nn.Module:
        """The loss this dimension needs (tp: vocabulary-parallel cross-entropy); default unchanged."""
        return criterion

    def sync_gradients(self, model: nn.Module) -> None:
        """After backward, dimensions in REVERSE apply order: make this dimension's gradients whole/averaged."""

    def full_output(self, out: torch.Tensor) -> torch.Tensor:
        """Evaluation only: the whole model output from this rank's part (tp: the vocabulary shards gathered);
        default unchanged. Never called in a training step."""
        return out

    def owns_metrics(self) -> bool:
        """Does this rank count loss and metrics for its group? (tp: rank 0 of the group; dp: every rank.)"""
        return True

    def close(self) -> None:
        """At the end of the run, on every rank (pp: its timeline gathered and written); default nothing."""

    def state_key(self) -> dict:
        """What a checkpoint must match to be resumed, e.g. ``{"tp": 2}``; saved with it, checked on resume."""
        return {self.name: self.size}

    @staticmethod
    def price(*args, **kwargs) -> dict | None:
        """Placeholder for the advisor: the bytes this dimension moves per step; ``None``: not priced yet."""
        return None

"""The strategy interface: where the model and data live, how gradients meet, what a checkpoint holds.

A strategy never runs its own training loop; :func:`labkit.train.run.run` and :func:`labkit.train.loop.fit` call::

    model = strategy.prepare(model)
    optimizer, preconditioner = strategy.build_optimizer(model, spec)
    [strategy.load_state_dict(model, optimizer, state)]                 # --resume
    for epoch: strategy.set_epoch(epoch)
        for x, y: loss, out = strategy.forward_backward(model, x, y, criterion)
                  strategy.sync_gradients(model)
                  if strategy.step_committed(): [preconditioner.step()]; optimizer.step(); scheduler.step()
        strategy.epoch_end(); strategy.all_reduce_sum(metric sums)
        [save strategy.state_dict(model, optimizer) to strategy.checkpoint_file(out)]  # writes_checkpoint()

Its ``labkit train`` flags are the ``FLAGS`` literal of its module (see :mod:`labkit.flags`); the parsed
values arrive as ``options``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import common_terms, compute_scale, memory_terms
from labkit.dist import group as kdist
from labkit.dist.group import DistEnv
from labkit.errors import CheckpointError

if TYPE_CHECKING:
    from labkit.optim import OptimizerSpec


#: ``labkit advise`` (labkit.advisor.search): one plan, one process; priced by the function named
ADVISOR = {"price": "labkit.strategies.base:price_single", "plans": "one"}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 1, "flags": []}


class Strategy:
    """One device, or every rank training its own full copy with no communication.

    Subclasses override what differs; the defaults are the single-device behaviour.

    Args:
        env: this process's place in the job.
        options: the strategy's own command-line options (``add_arguments``), by ``dest`` name.
    """

    name = "single"
    #: build the model as a flat nn.Sequential (needed to cut it into stages)
    sequential_model = False
    #: every rank holds the same parameters and optimizer state (rank 0 alone writes ``checkpoint.pt``);
    #: False: each rank writes its own part to ``checkpoint.rank{r}.pt``
    replicated = True
    #: ``--amp`` reaches this strategy's forward passes (autocast is per thread: not where stages run in threads)
    supports_amp = True
    #: why not, when ``supports_amp`` is False (the end of ``--amp``'s error line)
    amp_note = ""

    def __init__(self, env: DistEnv, options: dict | None = None):
        self.env = env
        self.options = dict(options or {})

    @property
    def input_device(self) -> torch.device:
        return self.env.device

    @property
    def target_device(self) -> torch.device:
        return self.env.device

    @property
    def data_parallel_size(self) -> int:
        """How many ranks each see a different shard of every batch (global batch = this × per-rank batch)."""
        return 1

    def per_rank_batch_size(self, batch_size: int) -> int:
        """This rank's batch given ``--batch-size``; a strategy may derive it from its own flags instead."""
        return batch_size

    def check_model(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        """Raise :class:`~labkit.errors.ConfigError` if this strategy cannot train ``--model model_name`` built with
        ``seq_len`` tokens per example (a GPT's block size) and ``dropout``; called before the data and the model
        are built."""

    def check_batch(self, batch_size: int) -> None:
        """Raise :class:`~labkit.errors.ConfigError` if this strategy cannot step on batches of ``batch_size``
        samples per rank (e.g. more micro-batches than samples); called with :meth:`check_model`, before any work."""

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.env.device)

    def sampler(self, dataset: Dataset, train: bool, seed: int) -> Sampler | None:
        return None

    def set_epoch(self, epoch: int) -> None:
        pass

    def seed_rank(self, rank: int) -> int:
        """The number ``fit`` adds to the default random stream's seed for global ``rank``: ranks with the same
        number draw the same dropout masks (the mesh: the ranks of one tp group, :mod:`labkit.parallel.tp_rng`)."""
        return rank

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return model(x)

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        out = model(x)           # (B, num_classes)
        loss = criterion(out, y)
        loss.backward()
        return loss.detach(), out.detach()

    def sync_gradients(self, model: nn.Module) -> None:
        pass

    def step_committed(self) -> bool:
        """May this step's update be applied? Asked by the loop after :meth:`sync_gradients`; False (``--strategy ft``
        when the quorum's all-reduce did not complete) skips the preconditioner, the optimizer, the schedule and the
        step's metric sums on every member alike. Always True here: no extra work, no communication."""
        return True

    def join(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict | None:
        """Called once before training, after the optimizer and schedule exist: a replica joining a live run copies
        its peers' state into them and returns where to start, ``{"epoch", "position"}`` (as a resume does); None
        (here: always) starts from the beginning or the ``--resume`` checkpoint."""
        return None

    def metric_owner(self) -> bool:
        return True

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def devices(self) -> list[torch.device]:
        return [self.env.device]

    # ----- optimizer and checkpoint hooks ------------------------------------------------------------

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> tuple[torch.optim.Optimizer, Any]:
        """``(optimizer, preconditioner or None)`` for the prepared ``model``.

        Default: ``spec`` over the whole unwrapped model. A sharded strategy builds it over the shard its rank
        owns, or refuses an optimizer it cannot shard with a :class:`~labkit.errors.ConfigError`.
        """
        return spec.build(self.unwrap(model))

    def checkpoint_file(self, out_dir: str | Path) -> Path:
        """``<out>/checkpoint.pt``, or ``<out>/checkpoint.rank{r}.pt`` when each rank holds different state."""
        suffix = "" if self.replicated else f".rank{self.env.rank}"
        return Path(out_dir) / f"checkpoint{suffix}.pt"

    def writes_checkpoint(self) -> bool:
        """Does this rank write a checkpoint file? (rank 0 alone when replicated, else every rank)"""
        return self.env.is_main or not self.replicated

    def placement(self, model: nn.Module) -> dict:
        """What a resumed run needs to put every layer where this one did (e.g. the balance a partitioned model
        measured on its first batch), saved with the checkpoint; empty where ``prepare`` places everything."""
        return {}

    def place(self, model: nn.Module, state: dict) -> None:
        """Put every layer on the device it trains on, as ``state``'s :meth:`placement` says, before the state is
        loaded: optimizer moments and K-FAC factors land on their parameters' devices only if those are final.
        Nothing to do where ``prepare`` placed the model."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's model and optimizer state: ``{"model", "optimizer"}`` and the :meth:`placement`, plus, when
        not replicated, ``"world_size"`` (the parts only fit a job of the same size)."""
        state = {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                 **self.placement(model)}
        if not self.replicated:
            state["world_size"] = self.env.world_size
        return state

    def reshard_refusal(self) -> str | None:
        """Why this strategy's checkpoints resume only on the setup that wrote them (one clause), or None: they
        reshard (:mod:`labkit.train.reshard`). The single device (this class itself, not a subclass) and the mesh
        reshard; other strategies do not."""
        return None if type(self) is Strategy else f"--strategy {self.name} does not reshard"

    def shard_layout(self, model: nn.Module) -> dict:
        """How this rank's tensors cut the whole model: ``{name: [dim, part, parts, whole shape]}`` for each tensor
        held in part (a tensor-parallel shard), saved with the checkpoint; a name not listed is whole. Asked only
        where :meth:`reshard_refusal` is None. One device: everything is whole."""
        return {}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Restore what :meth:`state_dict` saved.

        Raises:
            CheckpointError: the state does not fit this model, optimizer or world size.
        """
        saved = state.get("world_size", self.env.world_size)
        if not self.replicated and saved != self.env.world_size:
            raise CheckpointError(f"the checkpoint was written by {saved} ranks but this job has {self.env.world_size};"
                                  f" resume with {saved} ranks or start without --resume")
        self.place(model, state)
        try:
            self.unwrap(model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"the checkpoint does not fit this model/optimizer: {str(exc)[:200]}") from None

    def epoch_end(self) -> None:
        """Called by the loop on every rank after an epoch's last step and its throughput window, before the
        epoch's metric sums meet: a strategy whose ranks run steps on their own schedule within the epoch (the
        parameter server) brings them together here. Nothing to do by default."""

    def step_boundary(self) -> bool:
        """Called between two steps before the loop's own collective there (the stop check, the barriers of the
        throughput window). True: every rank can join one now; False: the ranks run different numbers of steps
        and the loop waits for the epoch's end."""
        return True

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small metrics tensor over every rank of the job (identity for one process)."""
        if self.env.distributed:
            values = kdist.all_reduce(values).cpu()
        return values

    def close(self) -> None:
        pass


def price_single(plan, prof, topo) -> Estimate:
    """One device: ``compute = s·T_all(B)``; memory ``3P + M_all(B)``."""
    B = plan.batch_size
    time = {"compute": compute_scale(topo, 1, prof) * prof.time(B), **common_terms(prof, topo, prof.param_bytes, B)}
    return Estimate(plan, time, memory_terms(prof, topo, prof.param_bytes, prof.saved_bytes(B)))

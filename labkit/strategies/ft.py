"""Fault-tolerant data parallelism across replica groups: a lost replica does not end the run.

    labkit train --ft-replicas 3 --model mlp --dataset synthetic-mnist --steps 40          # 3 replicas, 1 process each
    labkit train --ft-replicas 3 --ft-kill 1@12 ...      # drill: replica 1 dies in step 12, restarts, heals

``labkit train --ft-replicas R`` (``--strategy ft``) starts a supervisor (:mod:`labkit.train.ft_supervise`) that
hosts the job's store and runs each replica as its own process: ``labkit train ... --ft-replica r --ft-store
HOST:PORT``. There is no process group over the whole job, so no dead peer can break it. Per step each replica
trains on its shard of the global batch, then the members of the step's quorum all-reduce the gradients over a gloo
group of their own, vote, and apply the step only when every member's all-reduce completed
(:mod:`labkit.strategies.ft_quorum`).

What a step means when the quorum shrinks:

* **Gradients** are summed over the Q live members and divided by Q: the mean over the Q × b samples trained on.
  The learning rate is not rescaled (the global batch is Q × b for that step; ``--scale-lr`` scales by R).
* **Data**: replica r's shard of global step k is ``DistributedSampler(num_replicas=R, rank=r)``'s k-th batch, as
  under ``--strategy ddp`` with R ranks, so a full quorum trains exactly the one-process order
  (:func:`labkit.data.loader.global_order`). A sample is trained on at most once. The samples a step does not train
  on are dropped, never re-assigned: the shards of replicas outside the quorum of step k, and every shard of a
  discarded step k. Each replica appends, per step, the sample indices it was handed, its quorum and the decision to
  ``--ft-log`` (the supervisor's ``<out>/ft_replica<r>.jsonl``), so the accounting is checked, not assumed.
* **Steps**: a discarded step still consumes its place in the data order (every member moves on to step k + 1);
  the optimizer, the schedule and the metric sums count committed steps only (``Strategy.step_committed``).
* **Healing**: a restarted replica asks to join; the next decision admits it, and the lowest surviving member
  publishes its model, optimizer and schedule state at the start of the following step, which the joiner loads
  before it trains that step (``Strategy.join``).

**A replica that is itself a mesh** (``--mesh tp=2``, ``pp=2``, ``dp=2,tp=2``, ...: HSDP's shape, with the
replicas as its outer, fault-tolerant data-parallel dimension): each replica is ``W`` processes, a process group of
its own over which :class:`~labkit.parallel.mesh.MeshStrategy` trains as under torchrun; rank ``c`` of every
replica holds the same part of the model, so the replicas' all-reduce, vote and healing run per coordinate ``c``
(:mod:`labkit.strategies.ft_quorum`), after the mesh's own gradient synchronisation. Replica ``r``'s samples are
``DistributedSampler(num_replicas=R × D, rank=r × D + d)`` for the mesh's ``D`` data-parallel shards (``d``: this
rank's), the order ``--strategy ddp`` on ``R × D`` ranks trains. A replica lives or dies whole: when one of its
processes ends, the supervisor stops the others and restarts all ``W``. ZeRO/FSDP shards (``--dp-shard``) and
``--sync local-sgd|diloco`` inside a replica are refused: their gradients or their meetings are the replica's own
data-parallel dimension's, which the replicas' all-reduce would have to follow shard by shard.

The gradients travel over gloo on CPU copies: a gloo group whose peer died can be dropped and a new one formed; an
NCCL communicator would need an abort.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset, DistributedSampler, Sampler

from labkit.errors import ConfigError
from labkit.strategies.base import Strategy
from labkit.strategies.ft_quorum import Quorum, connect

#: a replica may be a mesh: ``--mesh`` and every mesh dimension's flags (labkit.strategies.strategy_flags)
SHARED_FLAGS = {"labkit.parallel.mesh": ["--mesh"]}
DIMENSION_FLAGS = True
FLAGS = [
    {"flag": "--ft-replicas", "type": "int", "range": "[1, 64]", "default": 2,
     "help": "replica groups (one process each) that train together and survive each other's loss"},
    {"flag": "--ft-timeout-s", "type": "float", "range": "(0, 3600]", "default": 10.0,
     "help": "how long a replica waits for its peers' votes (and a new group) before it counts them lost"},
    {"flag": "--ft-kill", "default": None, "metavar": "REPLICA@STEP",
     "help": "drill: replica REPLICA dies (SIGKILL) in step STEP after its backward pass; the supervisor restarts "
             "it and it heals from a peer; the summary reports the loss gap to an uninterrupted run"},
    {"flag": "--ft-restart-delay-s", "type": "float", "range": "[0, 3600]", "default": 0.0, "metavar": "SECONDS",
     "help": "how long the supervisor waits before it restarts a lost replica (the drill: a replica that stays away "
             "for a while)"},
    {"flag": "--ft-restarts", "type": "int", "range": "[0, 100]", "default": 3,
     "help": "how many times the supervisor restarts each replica"},
    {"flag": "--ft-replica", "type": "int", "range": "[0, 63]", "default": None, "hidden": True,
     "help": "this process is (a rank of) replica N (set by the supervisor, or by srun on a cluster)"},
    {"flag": "--ft-store", "default": None, "hidden": True, "help": "HOST:PORT of the job's store"},
    {"flag": "--ft-log", "default": None, "hidden": True, "help": "the replica's per-step record (JSON lines)"},
]


def refuse_inside(options: dict) -> None:
    """A ConfigError for what a replica's own mesh cannot hold (see the module's docstring), before any work."""
    from labkit.dist.mesh import MeshShape

    shape = MeshShape.parse(options["mesh"])
    if shape["dp"] > 1 and options.get("dp_shard", "none") != "none":
        raise ConfigError(f"--ft-replicas with --mesh {options['mesh']} --dp-shard {options['dp_shard']}: the "
                          "replicas all-reduce whole gradients; ZeRO/FSDP shards inside a replica are not supported "
                          "(use --dp-shard none)")
    if shape["dp"] > 1 and options.get("sync", "every-step") != "every-step":
        raise ConfigError(f"--ft-replicas with --sync {options['sync']}: the replicas meet every step; local SGD and "
                          "DiLoCo inside a replica are not supported")


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as this rank holds it (a DTensor's local shard: the part the replicas' coordinate c shares)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def parse_kill(text: str | None, replicas: int) -> tuple[int, int] | None:
    """``"1@12"`` -> (replica 1, step 12); None for None; a ConfigError naming the fix otherwise."""
    if text is None:
        return None
    replica, sep, step = text.partition("@")
    if not sep or not replica.isdigit() or not step.isdigit():
        raise ConfigError(f"--ft-kill {text!r} is not REPLICA@STEP, e.g. --ft-kill 1@12")
    if int(replica) >= replicas:
        raise ConfigError(f"--ft-kill {text}: there are {replicas} replicas (0 to {replicas - 1})")
    if int(step) < 1:
        raise ConfigError(f"--ft-kill {text}: kill at step 1 or later (step 0 forms the first quorum)")
    return int(replica), int(step)


class FaultTolerantStrategy(Strategy):
    """One replica of a fault-tolerant run (``--ft-replica r``), or one rank of it when the replica is a mesh; see
    the module's docstring."""

    name = "ft"

    def __init__(self, env, options: dict | None = None):
        super().__init__(env, options)
        self.replicas = self.options.get("ft_replicas", 2)
        self.replica = self.options.get("ft_replica")
        if self.replica is None or self.options.get("ft_store") is None:
            raise ConfigError("--strategy ft runs under its supervisor: labkit train --ft-replicas R ...")
        self.mesh = bool(self.options.get("mesh"))
        if self.mesh:  # the replica's own mesh, whose rank this process is
            from labkit.parallel.mesh import MeshStrategy

            refuse_inside(self.options)
            self.inner = MeshStrategy(env, self.options)
        elif env.distributed:
            raise ConfigError("--strategy ft starts its replicas itself: run labkit train --ft-replicas R without "
                              "torchrun (a replica of several ranks: --mesh)")
        else:  # one process: the single device's behaviour
            self.inner = Strategy(env, self.options)
        self.replicated = self.inner.replicated
        if self.replica >= self.replicas:
            raise ConfigError(f"--ft-replica {self.replica}: there are {self.replicas} replicas")
        self.kill = parse_kill(self.options.get("ft_kill"), self.replicas)
        timeout = float(self.options.get("ft_timeout_s", 10.0))
        self.quorum = Quorum(connect(self.options["ft_store"], max(timeout, 30.0)), self.replica, self.replicas,
                             timeout, coordinate=env.rank, width=env.world_size)
        self.step = 0  # the step of the run (committed or discarded), the same on every member
        self.committed = True
        self.batch_size = 1
        self._sampler: DistributedSampler | None = None
        self._epoch_ids: list[int] = []
        self._pending = None  # a decision whose joiners this replica publishes for at the next step
        self._held = None  # (model, optimizer, scheduler): what a joiner copies
        # the replica's per-step record (a mesh: one per rank, ft_replica<r>.rank<c>.jsonl; the timeline merges them)
        self._log = Path(self.options["ft_log"]) if self.options.get("ft_log") else None
        if self._log is not None and env.world_size > 1:
            self._log = self._log.with_name(f"{self._log.stem}.rank{env.rank}{self._log.suffix}")
        self._loss = None

    # ----- what the replica's own strategy decides (a mesh, or the single device) -------------------------

    @property
    def input_device(self) -> torch.device:
        return self.inner.input_device

    @property
    def target_device(self) -> torch.device:
        return self.inner.target_device

    def check_model(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        self.inner.check_model(model_name, seq_len, dropout)
        self.sequential_model = self.inner.sequential_model

    def check_batch(self, batch_size: int) -> None:
        self.inner.check_batch(batch_size)

    def prepare(self, model: nn.Module) -> nn.Module:
        return self.inner.prepare(model)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return self.inner.forward(model, x)

    def seed_rank(self, rank: int) -> int:
        return self.inner.seed_rank(rank)

    def metric_owner(self) -> bool:
        return self.inner.metric_owner()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.inner.unwrap(model)

    def devices(self) -> list[torch.device]:
        return self.inner.devices()

    def build_optimizer(self, model: nn.Module, spec):
        return self.inner.build_optimizer(model, spec)

    def state_dict(self, model: nn.Module, optimizer) -> dict:
        return self.inner.state_dict(model, optimizer)

    def load_state_dict(self, model: nn.Module, optimizer, state: dict) -> None:
        self.inner.load_state_dict(model, optimizer, state)

    def close(self) -> None:
        self.inner.close()

    # ----- data: replica r's shard of the global batch --------------------------------------------------

    def _shards(self) -> tuple[int, int]:
        """``(shards, this rank's)`` over the whole run: the replica's mesh's data-parallel shards within its own."""
        inner, index = self.inner.data_shard() if self.mesh else (1, 0)
        return self.replicas * inner, self.replica * inner + index

    @property
    def data_parallel_size(self) -> int:
        return self._shards()[0]

    def per_rank_batch_size(self, batch_size: int) -> int:
        self.batch_size = batch_size
        return batch_size

    def sampler(self, dataset: Dataset, train: bool, seed: int) -> Sampler | None:
        if not train:  # every replica evaluates the whole test set on the same weights (a mesh: as it shards it)
            return self.inner.sampler(dataset, False, seed)
        shards, index = self._shards()
        self._sampler = DistributedSampler(dataset, num_replicas=shards, rank=index, shuffle=True, seed=seed,
                                           drop_last=True)
        return self._sampler

    def set_epoch(self, epoch: int) -> None:
        if self._sampler is not None:
            self._sampler.set_epoch(epoch)
            self._epoch_ids = list(self._sampler)  # what the loader hands out this epoch, in order

    @property
    def steps_per_epoch(self) -> int:
        return len(self._sampler) // self.batch_size

    # ----- healing and the step ---------------------------------------------------------------------------

    def _state(self, model, optimizer, scheduler) -> dict:
        return {**self.state_dict(model, optimizer),
                "scheduler": scheduler.state_dict() if scheduler is not None else None, "step": self.step}

    def join(self, model: nn.Module, optimizer, scheduler) -> dict | None:
        self._held = (model, optimizer, scheduler)
        if not self.quorum.live():
            return None
        state = self.quorum.join()
        self.load_state_dict(model, optimizer, state)
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self._record({"event": "healed", "step": self.step, "incarnation": self.quorum.incarnation,
                      "members": list(self.quorum.members), "seconds": round(state["heal_s"], 3)})
        epoch, within = divmod(self.step, self.steps_per_epoch)
        ranks = range(self.env.world_size)  # the position a resume reads, one entry per rank of the replica
        position = None if within == 0 else {"step": within, "rng": [torch.get_rng_state() for _ in ranks],
                                             "totals": [torch.zeros(3, dtype=torch.float64) for _ in ranks],
                                             "cuda_rng": [[] for _ in ranks]}
        return {"epoch": epoch, "position": position}

    def forward_backward(self, model, x, y, criterion):
        if self._pending is not None:  # the members admitted joiners: the lowest voter hands them the state
            self.quorum.publish(self._pending, self._state(*self._held))
            self._pending = None
        loss, out = self.inner.forward_backward(model, x, y, criterion)
        self._loss = loss
        return loss, out

    def sync_gradients(self, model: nn.Module) -> None:
        self.inner.sync_gradients(model)  # the replica's own mesh first (its dp, tp, ... as under torchrun)
        if self.kill is not None and self.kill == (self.replica, self.step) and self.quorum.incarnation == 1:
            if self.env.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # the drill: (a process of) this replica is lost mid-step
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.detach().reshape(-1).cpu() for g in grads])
        members = self.quorum.members
        ok = self.quorum.all_reduce(flat)
        decision = self.quorum.vote(self.step, ok)
        self.committed = decision.committed
        if self.committed:
            flat /= len(members)
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n
        if decision.joiners and self.quorum.source(decision) == self.replica:
            self._pending = decision
        within = self.step % self.steps_per_epoch
        self._record({"step": self.step, "epoch_steps": self.steps_per_epoch, "members": list(members),
                      "committed": self.committed,
                      "loss": float(self._loss) if self._loss is not None else None,
                      "ids": self._epoch_ids[within * self.batch_size:(within + 1) * self.batch_size],
                      "next": list(decision.members)})
        self.step += 1

    def step_committed(self) -> bool:
        return self.committed

    def _record(self, record: dict) -> None:
        if self._log is not None:
            with self._log.open("a") as f:
                f.write(json.dumps({"replica": self.replica, "t": round(time.time(), 3), **record}) + "\n")

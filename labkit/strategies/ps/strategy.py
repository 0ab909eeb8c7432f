"""Data parallelism through a parameter server: synchronous, asynchronous, or stale-synchronous.

    torchrun --nproc_per_node 3 -m labkit train --strategy ps --ps-mode sync            # 1 server, 2 workers
    torchrun --nproc_per_node 4 -m labkit train --strategy ps --ps-mode async --ps-slow-worker 3:4
    torchrun --nproc_per_node 4 -m labkit train --strategy ps --ps-mode ssp --max-staleness 2 \\
        --ps-record runs/ssp-record.json

Ranks ``0 .. S-1`` are servers (``--ps-servers S``), the others workers (the seed-001 *centralised*
architecture; ``--strategy ddp`` is the decentralised one). Each server holds whole parameter tensors, a
shard of the model. A worker computes a gradient on its batch, pushes each shard's part to its server and
waits for the reply: that shard's new parameters (its pull). The server's side, and what ``sync``,
``async`` and ``ssp`` mean, is in :mod:`labkit.strategies.ps.server`.

It runs through the one training loop: on a server ``sync_gradients`` receives the push(es) and writes
them into ``.grad``, the loop's ``optimizer.step()`` applies them (so the optimizer and its schedule live
on the servers, as in a real parameter server), and the replies go out at the next step. On a worker the
pulled parameters replace the model's and ``.grad`` is cleared, so its own ``optimizer.step()`` does
nothing. One step of the loop is one *update*: a round of every worker in ``sync`` mode (global batch
W × batch), one push in ``async``/``ssp`` (batch). In async/ssp each worker samples the whole training set
in its own order and an epoch ends after as many updates as one worker alone would make; a fast worker
makes more of them than a slow one. At the end of an epoch every server broadcasts its shard, so every
rank holds the same model for evaluation and checkpoints. K-FAC does not fit: its factors come from the
forward pass, which runs on the workers while the update runs on the servers.

**Momentum under asynchrony.** W workers pushing asynchronously act like an extra, implicit momentum of about
1 − 1/W (Mitliagkas et al. 2016, "Asynchrony begets momentum"): a gradient computed τ updates ago is an
echo of the steps since. On top of the optimizer's own momentum 0.9 this was too much: LeNet on the digits
(lr 0.05, 2 workers, batch 32, 2,048 samples) stalled at chance in async mode and reached 41 % after 3
epochs in SSP (K = 1), where sync reached 91 %; with momentum 0.5 async reached 91 % and SSP 89 %, with
momentum 0 84 %. So in async and SSP mode the servers' momentum is ``--momentum − (1 − 1/W)`` (at least 0)
unless ``--ps-momentum`` sets it (SGD and LARS; Adam and LAMB keep their β₁); sync keeps ``--momentum``.

**Pre-emption.** In sync mode every rank runs the same steps, so a stop signal is handled as in the other
strategies: the ranks agree after a step (the server first answers that step's pushes), checkpoint the
position and exit; ``--resume`` continues bit-identically (with S servers each rank writes its own
checkpoint: a server's shard and optimizer state are its own). In async and SSP mode servers and workers run
different numbers of steps, so no per-step collective can bring them together: a stop signal is honoured at
the end of the epoch in progress (every rank agrees there), after its checkpoint; ``--resume`` continues from
that epoch, and the rest of the run depends on arrival order as any async run does.
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, Sampler

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import common_terms, compute_scale, memory_terms, message_time
from labkit.dist import group as kdist
from labkit.dist.group import DistEnv, print0
from labkit.errors import ConfigError
from labkit.optim import OptimizerSpec
from labkit.results import atomic_write_text
from labkit.strategies.base import Strategy
from labkit.strategies.ps.options import read_options
from labkit.strategies.ps.server import ServerState, shard_tensors
from labkit.strategies.ps.worker import push_pull, worker_sampler

FLAGS = [
    {"flag": "--ps-mode", "default": "sync", "choices": ["sync", "async", "ssp"],
     "help": "sync: a round of every worker per update; async: each push applied as it arrives; ssp: async, but "
             "no worker more than --max-staleness clocks ahead of the slowest"},
    {"flag": "--ps-servers", "type": "int", "range": "[1, inf)", "default": 1, "metavar": "S",
     "help": "server ranks 0..S-1"},
    {"flag": "--max-staleness", "type": "int", "range": "[0, inf)", "default": None, "metavar": "K",
     "help": "ssp only: how many clocks a worker may run ahead of the slowest (None: 2)"},
    {"flag": "--ps-momentum", "type": "float", "range": "[0, 1)", "default": None, "metavar": "MU",
     "help": "async/ssp: the servers' momentum (None: --momentum minus the 1 - 1/W that W asynchronous workers "
             "add implicitly, at least 0)"},
    {"flag": "--ps-slow-worker", "default": None, "metavar": "RANK:FACTOR",
     "help": "straggler demo: worker RANK sleeps FACTOR-1 times its last step (compute, push, pull) before each "
             "step (None: no straggler)"},
    {"flag": "--ps-timeout-s", "type": "float", "range": "(0, 1e7]", "default": 300.0,
     "help": "a server or worker that hears nothing for this long stops with an error"},
    {"flag": "--ps-record", "default": None, "metavar": "FILE",
     "help": "write every update's staleness, clock and time as JSON (None: not written)"},
]
#: ``labkit advise``: ``p`` ranks, ``S`` of them servers (the option named), the batch split over the workers
ADVISOR = {"price": "labkit.strategies.ps.strategy:price_ps", "plans": "servers", "servers": "ps_servers",
           "batch": "workers"}
#: backend/device combinations it cannot run on (labkit.strategies.backends): asynchronous servers receive from anyone; every
#: mode sends point to point, which gloo does on CPU tensors only (on CUDA ones its transport fails: "writev ...
#: Bad address", seen on an H200 with --ps-mode sync)
BACKENDS = [
    {"when": {"ps_mode": ["async", "ssp"]}, "backend": "nccl", "device": "*",
     "why": "--ps-mode {ps_mode} receives pushes from any worker, which NCCL cannot do; use --backend gloo (CPU "
            "tensors) or --ps-mode sync"},
    {"backend": "gloo", "device": "cuda",
     "why": "--strategy ps (--ps-mode {ps_mode}) sends and receives point to point, which gloo does on CPU tensors "
            "only; use --device cpu (or leave --device auto), or --backend nccl with --ps-mode sync"},
]

class ParameterServerStrategy(Strategy):
    """Servers hold the parameters and apply the optimizer; workers compute gradients (module docstring).

    Options: ``ps_mode`` (sync | async | ssp), ``ps_servers`` S, ``max_staleness`` K (ssp), ``ps_slow_worker``
    ``RANK:FACTOR``, ``ps_timeout_s``, ``ps_record`` (a JSON file for the per-update record).

    Attributes:
        server: this rank's :class:`~labkit.strategies.ps.server.ServerState` (None on workers); its
            ``record`` holds one entry per applied push: version, worker, clock, staleness, ahead, time_s.
    """

    name = "ps"

    def __init__(self, env: DistEnv, options: dict | None = None):
        super().__init__(env, options)
        checked = read_options(env, self.options)
        self.mode, self.num_servers, self.max_staleness = checked.mode, checked.num_servers, checked.max_staleness
        self.momentum, self.timeout_s, self.slow = checked.momentum, checked.timeout_s, checked.slow
        self.workers = checked.workers
        self.is_server = env.rank < self.num_servers
        # one server holds all optimizer state; with several each server checkpoints its own shard's
        self.replicated = self.num_servers == 1
        self.index = 0 if self.is_server else env.rank - self.num_servers  # this worker's place among workers
        self.server: ServerState | None = None
        self.stopped_by: set[int] = set()
        self._samplers: list[DistributedSampler] = []
        self._epoch_open = False
        self._step_s = 0.0  # this worker's last step, without the injected delay

    def build_optimizer(self, model: nn.Module, spec: OptimizerSpec):
        if spec.name == "kfac":
            raise ConfigError("--strategy ps applies the optimizer on the servers, but K-FAC's factors come from "
                              "the forward pass on the workers; use --strategy ddp for K-FAC")
        if spec.name in ("shampoo", "soap", "muon"):
            raise ConfigError(f"--strategy ps steps the optimizer on the servers alone, but --optimizer {spec.name} "
                              "splits its matrices over every rank of the job; use --strategy ddp")
        if self.mode != "sync" and spec.name in ("sgd", "lars"):  # Adam and LAMB keep their β₁
            spec = dataclasses.replace(spec, momentum=self.server_momentum(spec.momentum))
        return super().build_optimizer(model, spec)

    def server_momentum(self, momentum: float) -> float:
        """The servers' explicit momentum in async/ssp mode: μ − (1 − 1/W), at least 0 (module docstring).

        Args:
            momentum: ``--momentum`` μ (what sync mode uses as is).
        """
        if self.momentum is not None:
            return self.momentum
        implicit = 1 - 1 / len(self.workers)
        explicit = max(0.0, momentum - implicit)
        if implicit and momentum and self.env.is_main:
            print0(f"ps {self.mode}: {len(self.workers)} asynchronous workers add a momentum of about {implicit:.2f}; "
                   f"the servers use momentum {explicit:.2f} instead of {momentum:g} (--ps-momentum sets it)")
        return explicit

    @property
    def data_parallel_size(self) -> int:
        return len(self.workers) if self.mode == "sync" else 1

    def prepare(self, model: nn.Module) -> nn.Module:
        model = model.to(self.env.device)
        with torch.no_grad():  # every rank starts from rank 0's weights
            for tensor in [*model.parameters(), *model.buffers()]:
                kdist.broadcast(tensor, src=0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.owner = shard_tensors(self.params, self.num_servers)
        self.shards = [[p for p, o in zip(self.params, self.owner) if o == s] for s in range(self.num_servers)]
        if any(not shard for shard in self.shards):
            raise ConfigError(f"the model has {len(self.params)} parameter tensors, too few for "
                              f"--ps-servers {self.num_servers}; use fewer servers")
        if self.is_server:
            self.server = ServerState(self.shards[self.env.rank], self.workers, self.mode, self.max_staleness,
                                      self.timeout_s)
        return model

    def sampler(self, dataset: Dataset, train: bool, seed: int) -> Sampler | None:
        sampler = worker_sampler(dataset, train, seed, self.mode, len(self.workers), self.index, self.is_server)
        if train:
            self._samplers.append(sampler)
        return sampler

    def set_epoch(self, epoch: int) -> None:
        for sampler in self._samplers:
            sampler.set_epoch(epoch)
        self.stopped_by = set()
        if self.server is not None:
            self.server.start_epoch()

    # ----- a step ----------------------------------------------------------------------------------------

    def forward_backward(self, model, x, y, criterion):
        self._epoch_open = True
        if self.is_server:
            self.server.after_step(budget_reached=False)  # the loop's optimizer step applied the last push
            return None, None
        if len(self.stopped_by) == self.num_servers:
            return None, None  # the epoch's updates are done; the rest of this worker's batches are skipped
        if self.slow is not None and self.slow[0] == self.env.rank:
            time.sleep((self.slow[1] - 1) * self._step_s)  # its last step (compute + push/pull) took _step_s
        self._started = time.perf_counter()
        out = model(x)  # (B, num_classes)
        loss = criterion(out, y)
        loss.backward()
        return loss.detach(), out.detach()

    def sync_gradients(self, model: nn.Module) -> None:
        if self.is_server:
            self.server.set_grads(self.server.receive(len(self.workers) if self.mode == "sync" else 1))
        elif len(self.stopped_by) < self.num_servers:
            self._push_pull()
            self._step_s = time.perf_counter() - self._started

    def _push_pull(self) -> None:
        """Push each shard's gradient to its server, wait for the replies, load the pulled parameters."""
        servers = [s for s in range(self.num_servers) if s not in self.stopped_by]
        self.stopped_by |= push_pull(self.shards, self.params, servers, self.env.device, self.timeout_s, self.env.rank)

    # ----- end of an epoch ------------------------------------------------------------------------------------

    def step_boundary(self) -> bool:
        if self.mode != "sync":
            # servers and async workers run different numbers of steps: a collective here would deadlock;
            # a stop signal stays recorded and the check after the epoch (a real collective) stops the run
            return False
        if self.server is not None and self._epoch_open:
            self.server.after_step(budget_reached=False)  # answer this step's pushes: workers wait for it
        return True

    def epoch_end(self) -> None:
        # the loop calls this after an epoch's steps, before its first collective there: answer the last
        # pushes and bring every rank the same model
        if self._epoch_open:
            self._finish_epoch()

    def _finish_epoch(self) -> None:
        """Answer the last pushes, then every server broadcasts its shard: all ranks hold the same model."""
        self._epoch_open = False
        if self.server is not None:
            self.server.after_step(budget_reached=self.mode != "sync")
            if self.mode != "sync":
                self.server.drain()
            self.server.flush()
        with torch.no_grad():
            for s, shard in enumerate(self.shards):
                flat = torch.nn.utils.parameters_to_vector(shard)
                kdist.broadcast(flat, src=s)
                torch.nn.utils.vector_to_parameters(flat, shard)

    def records(self) -> dict:
        """Every server's per-update record and bytes, gathered on every rank (a collective)."""
        mine = {"rank": self.env.rank, "updates": self.server.record, "bytes": self.server.bytes,
                "numel": self.server.numel} if self.server is not None else None
        gathered = [None] * self.env.world_size
        dist.all_gather_object(gathered, mine)
        return {"schema": "labkit.ps-record/1", "mode": self.mode, "servers": self.num_servers,
                "workers": self.workers, "max_staleness": self.max_staleness if self.mode == "ssp" else None,
                "per_server": [g for g in gathered if g is not None]}

    def close(self) -> None:
        path = self.options.get("ps_record")
        if path is None:
            return
        record = self.records()
        if self.env.is_main:
            atomic_write_text(path, json.dumps(record))


HEADER_BYTES = 16  # the reply's [version, stop] int64 pair


def shard_bytes(prof, servers: int) -> list[float]:
    """Bytes on each server: layers largest first, each to the least-loaded server."""
    load = [0.0] * servers
    for nbytes in sorted((layer.param_bytes for layer in prof.layers if layer.param_bytes), reverse=True):
        load[load.index(min(load))] += nbytes
    return load


def price_ps(plan, prof, topo) -> Estimate:
    """One synchronous update: every worker computes, pushes, waits; each server sums, steps, replies.

    ``compute = s_W·T_all(b)`` with ``s_W`` the compute scale of the ``W`` workers computing at once
    (:func:`labkit.advisor.topology.compute_scale`; the servers sleep in their receive while the workers compute); ``communication = W·(2·msg(P_max) + msg(16)) + γ·W·P_max``
    (the fullest server takes ``W`` pushes, sums them, and sends each worker a header and its parameters);
    ``update = u·P_max`` (the server's optimizer over its shard; a worker's step has no gradient to apply);
    ``data = d·b``. Memory, the fuller of a worker ``P + P + 2P + M_all(b)`` (parameters, gradients, the flat
    push and the pulled copy) and a server ``3·P_max + 2W·P_max`` (its shard, gradient and momentum; the
    ``W`` received pushes and their stack).
    """
    servers = plan.option.get("ps_servers", 1)
    workers = plan.processes - servers
    if workers < 1:
        return Estimate(plan, note=f"--ps-servers {servers} leaves no worker among {plan.processes} ranks")
    if sum(1 for layer in prof.layers if layer.param_bytes) < servers:
        return Estimate(plan, note=f"fewer layers with parameters than --ps-servers {servers}")
    b, P = plan.batch_size / workers, prof.param_bytes
    fullest = max(shard_bytes(prof, servers))
    link = topo.link_of("p2p", plan.processes)
    comm = workers * (2 * message_time(fullest, topo, plan.processes) + message_time(HEADER_BYTES, topo, plan.processes)
                      ) + link.gamma * workers * fullest
    terms = {"compute": compute_scale(topo, workers, prof) * prof.time(b), "communication": comm,
            **common_terms(prof, topo, fullest, b)}
    worker = memory_terms(prof, topo, P, prof.saved_bytes(b), 2 * P)
    worker["optimizer"] = 0.0
    server = memory_terms(prof, topo, fullest, 0.0, 2 * workers * fullest)
    return Estimate(plan, terms, max(worker, server, key=lambda m: sum(m.values())))

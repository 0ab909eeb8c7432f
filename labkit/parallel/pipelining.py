"""Pipeline parallelism across processes: one stage per rank, micro-batches scheduled by
``torch.distributed.pipelining`` (GPipe fill-drain, or 1F1B as in PipeDream-flush).

    torchrun --nproc_per_node 2 -m labkit train --strategy pipeline --schedule 1f1b \\
        --model resnet50 --dataset mnist --batch-size 256 --num-microbatches 8 \\
        --pipeline-trace runs/pipe/timeline.json

Rank ``r`` keeps layers ``balance[r]`` of the ``nn.Sequential`` (``--balance``, default: layer counts as
even as possible). Every rank loads the same batches; rank 0 feeds the inputs, the last rank owns the
outputs, the targets and the loss, so only it returns ``(loss, output)`` to the training loop.

Schedules, per step with ``P`` stages and ``M`` micro-batches:

* ``gpipe``: all ``M`` forwards, then all ``M`` backwards; every stage holds ``M`` micro-batches' activations.
* ``1f1b``: after ``P - r`` warm-up forwards, stage ``r`` alternates one forward, one backward; it holds at
  most ``P - r`` micro-batches' activations. Same bubble ``(P - 1) / (M + P - 1)``, less memory.

Both scale gradients by ``1 / M`` (the loss is a mean per micro-batch), so a step equals one step on the
whole batch. A batch must split into equal micro-batches; a smaller last batch uses the largest ``m <= M``
that divides it.

The timeline (``--pipeline-trace``, see :class:`Timeline`) is measured, not modelled: the stage's
``forward_one_chunk`` / ``backward_one_chunk`` are wrapped with timers, and the schedule's waits on
send/receive handles are timed by wrapping the schedules module's ``_batch_p2p`` / ``_wait_batch_p2p``
(PyTorch internals: if a release renames them, the trace says ``"comm_recorded": false``).
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import common_terms, compute_scale, memory_terms, pipeline_terms, stages_of
from labkit.dist.group import DistEnv, print0
from labkit.errors import ConfigError
from labkit.parallel.pipeline_stages import (
    StageSchedules,
    even_balance,
    microbatches_for,
    pipeline_options,
    stage_layers,
    torch_pipelining,
)
from labkit.results import atomic_write_text
from labkit.strategies.balance import SavedActivations
from labkit.strategies.base import Strategy
from labkit.strategies.gpipe import check_balance, check_sequential

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

__all__ = ["PipelineStrategy", "Timeline", "StageSchedules", "even_balance", "microbatches_for", "stage_layers"]

#: ``labkit train --strategy pipeline`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--num-microbatches", "type": "int", "range": "[1, inf)", "default": 4, "metavar": "M",
     "help": "micro-batches per mini-batch"},
    {"flag": "--balance", "type": "int", "range": "[1, inf)", "nargs": "+", "default": None, "metavar": "N",
     "help": "layers per stage (one per rank), e.g. --balance 10 12 (None: even split by layer count)"},
    {"flag": "--schedule", "choices": ["gpipe", "1f1b"], "default": "gpipe", "help": "micro-batch schedule"},
    {"flag": "--pipeline-trace", "default": None, "metavar": "FILE",
     "help": "write the measured per-rank timeline (JSON) here (None: no trace)"},
    {"flag": "--trace-steps", "type": "int", "range": "[0, inf)", "default": None, "metavar": "N",
     "help": "steps to record after the first (None: 3 with --pipeline-trace, else 0)"},
]
#: backend/device combinations refused before any work (labkit.strategies.backends): gloo's send/recv take CPU tensors only
BACKENDS = [
    {"backend": "gloo", "device": "cuda",
     "why": "--strategy pipeline's stages send activations point to point, which gloo does on CPU tensors only; use "
            "--backend nccl on GPUs, or --device cpu (or leave --device auto)"},
]
#: ``labkit advise``: a stage per rank, ``m`` micro-batches, 1f1b where gpipe's does not fit (labkit.advisor.search)
ADVISOR = {"price": "labkit.parallel.pipelining:price_pipeline", "plans": "pipeline", "processes": "each",
           "options": {"microbatches": "num_microbatches", "balance": "balance", "schedule": "schedule"}}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 2, "flags": ["--num-microbatches", "4"]}


TRACE_SCHEMA = "labkit.pipeline-trace/1"




class Timeline:
    """Measured per-rank timeline of pipeline steps.

    Events are ``{"rank", "step", "kind", "mb", "start", "end"}`` with ``kind`` ``"F"`` / ``"B"`` (compute
    of micro-batch ``mb``) or ``"wait"`` (blocked on a send/receive handle; ``mb`` is None, ``label`` says
    which, e.g. ``fwd_recv``). Times are seconds since the step's origin: every rank passes a barrier, then
    reads its clock, so ranks share the origin up to the barrier's exit skew (microseconds on one node).
    Memory per step: ``saved_peak_bytes`` (peak bytes autograd kept for backward on this stage,
    :class:`~labkit.strategies.balance.SavedActivations`) and ``device_peak_bytes`` (CUDA only). On GPUs the
    recorded steps synchronise the device around each forward/backward, so a box spans the kernels' real
    run time; a wait then is time the host was blocked on a send/receive handle.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []
        self.memory: list[dict] = []
        self.comm_recorded = hasattr(torch_pipelining().schedules, "_batch_p2p") and \
            hasattr(torch_pipelining().schedules, "_wait_batch_p2p")
        self._step: int | None = None
        self._origin = 0.0
        self._labels: dict[int, str] = {}

    def _add(self, kind: str, mb: int | None, start: float, end: float, label: str | None = None) -> None:
        if self._step is not None:
            self.events.append({"rank": self.rank, "step": self._step, "kind": kind, "mb": mb, "label": label,
                                "start": start - self._origin, "end": end - self._origin})

    def instrument(self, stage: PipelineStage) -> None:
        """Time every forward and backward of every micro-batch this stage runs."""
        device = torch.device(stage.device)
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            setattr(stage, name, self._timed(kind, getattr(stage, name), device))

    def _timed(self, kind: str, fn, device: torch.device):
        def run(chunk_id: int, *args, **kwargs):
            recording = self._step is not None and device.type == "cuda"
            if recording:  # kernels run asynchronously: wait for them so the box spans the real compute
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = fn(chunk_id, *args, **kwargs)
            if recording:
                torch.cuda.synchronize(device)
            self._add(kind, chunk_id, start, time.perf_counter())
            return out
        return run

    @contextlib.contextmanager
    def record(self, step: int, device: torch.device, params):
        """Record step ``step``: align the clock with the other ranks, time comm waits, meter memory."""
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self._step, self._origin = step, time.perf_counter()
        _schedules = torch_pipelining().schedules
        originals = (getattr(_schedules, "_batch_p2p", None), getattr(_schedules, "_wait_batch_p2p", None))
        if self.comm_recorded:
            _schedules._batch_p2p = self._labelled(originals[0])
            _schedules._wait_batch_p2p = self._waited(originals[1])
        try:
            with SavedActivations(exclude=params) as meter:
                yield
        finally:
            if self.comm_recorded:
                _schedules._batch_p2p, _schedules._wait_batch_p2p = originals
            device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            self.memory.append({"rank": self.rank, "step": step, "saved_peak_bytes": meter.peak_bytes,
                                "device_peak_bytes": device_peak})
            self._step, self._labels = None, {}

    def _labelled(self, batch_p2p):
        def issue(ops, desc=None):
            works = batch_p2p(ops, desc=desc)
            for work in works:
                self._labels[id(work)] = desc or "p2p"
            return works
        return issue

    def _waited(self, wait):
        def blocked(works):
            start = time.perf_counter()
            wait(works)
            if works:
                self._add("wait", None, start, time.perf_counter(), self._labels.get(id(works[0]), "p2p"))
        return blocked


class PipelineStrategy(Strategy):
    """Stage ``rank`` of a ``world_size``-stage pipeline, driven by a torch.distributed.pipelining schedule."""

    name = "pipeline"
    sequential_model = True
    replicated = False

    def __init__(self, env: DistEnv, options: dict | None = None):
        super().__init__(env, options)
        if env.world_size < 2:
            raise ConfigError("--strategy pipeline puts one stage on each rank and needs >= 2 ranks: "
                              "torchrun --nproc_per_node 2 -m labkit train --strategy pipeline ...")
        self.schedule_name, self.num_microbatches = pipeline_options(self.options, env.world_size,
                                                                     f"{env.world_size} ranks")
        self.trace_path = self.options.get("pipeline_trace")
        trace_steps = self.options.get("trace_steps")
        self.trace_steps = int(trace_steps if trace_steps is not None else (3 if self.trace_path else 0))
        self.timeline = Timeline(env.rank) if self.trace_steps > 0 else None
        self.balance: list[int] | None = None
        self.stages = StageSchedules(env.rank, env.world_size, env.device, self.schedule_name, self.num_microbatches,
                                     timeline=self.timeline)
        self._steps = 0

    @property
    def is_first(self) -> bool:
        return self.stages.is_first

    @property
    def is_last(self) -> bool:
        return self.stages.is_last

    def prepare(self, model: nn.Module) -> nn.Module:
        model = check_sequential(model)
        given = self.options.get("balance")
        ranks = [f"rank {r}" for r in range(self.env.world_size)]
        self.balance = (check_balance(given, len(model), ranks) if given
                        else even_balance(len(model), self.env.world_size))
        print0(f"pipeline | {self.env.world_size} stages, balance {self.balance} | schedule {self.schedule_name} | "
               f"{self.num_microbatches} micro-batches")
        return stage_layers(model, self.balance, self.env.rank).to(self.env.device)

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        step, self._steps = self._steps, self._steps + 1
        recording = self.timeline is not None and 1 <= step <= self.trace_steps
        context = self.timeline.record(step, self.env.device, model.parameters()) if recording else None
        return self.stages.forward_backward(model, x, y, criterion, context)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return self.stages.forward(model, x)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def trace(self) -> dict | None:
        """Gather every rank's timeline; the trace dict on rank 0 (None elsewhere). Collective: all ranks call."""
        if self.timeline is None:
            return None
        local = {"events": self.timeline.events, "memory": self.timeline.memory}
        gathered = [None] * self.env.world_size if self.is_first else None
        dist.gather_object(local, gathered, dst=0)
        if not self.is_first:
            return None
        return {"schema": TRACE_SCHEMA, "schedule": self.schedule_name, "num_stages": self.env.world_size,
                "num_microbatches": self.num_microbatches, "balance": self.balance,
                "device": self.env.device.type, "backend": self.env.backend,
                "steps": sorted({e["step"] for g in gathered for e in g["events"]}),
                "comm_recorded": self.timeline.comm_recorded,
                "events": [e for g in gathered for e in g["events"]],
                "memory": [m for g in gathered for m in g["memory"]]}

    def close(self) -> None:
        trace = self.trace()
        if trace is not None and self.trace_path:
            atomic_write_text(Path(self.trace_path), json.dumps(trace) + "\n")
            print0(f"pipeline timeline written to {self.trace_path}")


def price_pipeline(plan, prof, topo) -> Estimate:
    """One stage per rank (``torch.distributed.pipelining``), ``m`` micro-batches of ``B/m``:

    ``t_j = s·T_{stage j}(B/m)``, ``c_j = 2·msg((B/m)·A_{last of j})`` (activation forward, gradient
    backward; 0 for the last stage), terms from :func:`pipeline_terms` along the critical path (the stages a
    search cuts are seldom equal).
    Every rank loads the whole batch.
    Memory of stage ``j``: ``3·P_j + k_j·M_j(B/m)`` with ``k_j = m`` (gpipe schedule) or
    ``min(p − j, m)`` (1f1b); the fullest stage counts.
    """
    o = plan.option
    p, m, B = plan.processes, o["num_microbatches"], plan.batch_size
    stages = stages_of(o["balance"])
    bm = B / m
    msg = topo.link_of("p2p", p).transfer_time
    times = [compute_scale(topo, p, prof) * prof.time(bm, s) for s in stages]
    comm = [2 * msg(bm * prof.layers[s[-1]].out_bytes) if j < p - 1 else 0.0 for j, s in enumerate(stages)]
    held = [m if o.get("schedule", "gpipe") == "gpipe" else min(p - j, m) for j in range(p)]
    mem = [memory_terms(prof, topo, prof.params(s), held[j] * prof.saved_bytes(bm, s)) for j, s in enumerate(stages)]
    full = max(range(p), key=lambda j: sum(mem[j].values()))
    terms = pipeline_terms(times, comm, m, critical_path=True)
    terms.update(common_terms(prof, topo, max(prof.params(s) for s in stages), B))
    return Estimate(plan, terms, mem[full])

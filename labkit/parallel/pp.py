"""The mesh's ``pp`` dimension: the model cut into stages along each ``pp`` column, micro-batches scheduled by
``torch.distributed.pipelining`` (``--schedule`` GPipe or 1F1B, as ``--strategy pipeline``) or by labkit's own
executor of a schedule written as data (``--pp-schedule``: :mod:`labkit.parallel.pp_schedule`,
:mod:`labkit.parallel.pp_runtime`; interleaved 1F1B with ``--pp-virtual`` chunks per rank, ZB-H1, ZBV, DualPipeV).

    torchrun --nproc_per_node 4 -m labkit train --mesh tp=2,pp=2 --model gpt-tiny --dataset text-sample \\
        --num-microbatches 4 --schedule 1f1b
    torchrun --nproc_per_node 4 -m labkit train --mesh pp=4 --pp-schedule zb-h1 --model lenet --dataset mnist-sample \\
        --num-microbatches 8

With ``--pp-schedule`` each rank holds ``v`` chunks (stages ``S = P·v``; rank ``r`` holds stages ``r, r + P, …``, or
``r`` and ``2P − 1 − r`` in a V), gathered in one :class:`~labkit.parallel.pp_runtime.RankStages` module.

The ``P`` ranks of one ``pp`` group (``mesh.get_group("pp")``, the same dp/ep/cp/tp coordinates) each hold one
stage: a GPT's blocks split as evenly as possible (stage 0 also holds the embeddings, the last ``ln_f`` and the
head, :mod:`labkit.parallel.pp_gpt`), or a CNN's ``nn.Sequential`` cut by layer count as ``--strategy pipeline``
cuts it; ``--balance`` gives the counts (blocks of a GPT, layers of a Sequential). Every stage loads the same
batch; the first feeds the inputs, the last owns the targets, the loss and the metrics.

The tied embedding. A GPT's (V, C) matrix embeds on stage 0 and predicts on stage P-1, so those two stages each
hold a copy. After backward (:meth:`PipelineParallel.sync_gradients`) the copies' gradients are summed over the
*embedding group*, the first and last rank of this ``pp`` column (Megatron's name); the copies start equal
(broadcast from stage 0 once) and so stay equal, and each step equals the single-process step of the tied model.
The group is not a mesh dimension: a mesh dimension's groups are whole lines of the grid, every rank of a ``pp``
column, but the middle stages hold no copy and must not join. So it is made with ``dist.new_group`` from the
mesh's own rank grid: every rank creates every column's group, in the same order (``new_group`` is collective
over the whole job), and keeps its own. With ``pp=2`` the pair is the ``pp`` group itself, which is reused.

The timeline (``--pipeline-trace FILE``, ``--trace-steps N``, :class:`Timeline`) is measured, not modelled: the
stage's ``forward_one_chunk`` / ``backward_one_chunk`` are wrapped with timers, and the schedule's waits on
send/receive handles are timed by wrapping the schedules module's ``_batch_p2p`` / ``_wait_batch_p2p`` (PyTorch
internals: if a release renames them, the trace says ``"comm_recorded": false``). The ranks of each ``pp`` column
gather their events to its first stage; the column of rank 0 writes the JSON (schema ``labkit.pipeline-trace/1``,
read by :mod:`labkit.viz.pipeline`) when the run closes.

Bytes per step of one ``pp`` column (one tp shard of one data-parallel replica), with per-rank batch ``B``,
sequence ``T``, width ``C``, vocabulary ``V``, ``s`` bytes per element (:meth:`PipelineParallel.price`)::

    activations = 2 (P - 1) B T C s / (tp if sequence parallel else 1)
                  # each of the P - 1 boundaries sends every micro-batch's (B/M, T, C) forward and its gradient
                  # backward: M micro-batches × 2 directions × (B/M) T C s; independent of M
    embedding   = 2 (V / tp) C s   # all-reduce of the tied gradient between 2 ranks: each sends its copy
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
from torch.distributed.device_mesh import DeviceMesh

from labkit.dist import group as kdist
from labkit.dist.group import print0
from labkit.errors import ConfigError
from labkit.models.gpt import GPT_SIZES
from labkit.models.names import LANGUAGE_MODELS
from labkit.parallel.base import Dimension, refuse_moe
from labkit.parallel.pipeline_stages import (
    StageSchedules,
    check_split,
    even_balance,
    pipeline_options,
    schedule_refusal,
    stage_layers,
    torch_pipelining,
)
from labkit.parallel.pp_gpt import TIED, GPTStage, is_gpt, is_tied
from labkit.parallel.pp_runtime import RankStages, ScheduleRuntime
from labkit.parallel.pp_schedule import chunks_of
from labkit.results import atomic_write_text
from labkit.strategies.balance import SavedActivations
from labkit.strategies.gpipe import check_balance, check_sequential

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

#: ``labkit train --mesh ...pp=P`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--num-microbatches", "type": "int", "range": "[1, inf)", "default": 4, "metavar": "M",
     "help": "pp dimension: micro-batches per mini-batch"},
    {"flag": "--schedule", "choices": ["gpipe", "1f1b"], "default": "gpipe",
     "help": "pp dimension: micro-batch schedule"},
    {"flag": "--pp-schedule", "choices": ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"],
     "default": None,
     "help": "pp dimension: run this schedule from labkit's own action lists (labkit.parallel.pp_schedule) instead "
             "of torch's --schedule; zb-h1, zbv and dualpipev split the backward into B and W"},
    {"flag": "--pp-virtual", "type": "int", "range": "[1, inf)", "default": None, "metavar": "V",
     "help": "pp dimension, with --pp-schedule: stages (chunks) per rank (None: the schedule's own; "
             "interleaved-1f1b: 2)"},
    {"flag": "--balance", "type": "int", "range": "[1, inf)", "nargs": "+", "default": None, "metavar": "N",
     "help": "pp dimension, per stage (per chunk with --pp-virtual): GPT blocks or Sequential layers, e.g. "
             "--balance 3 2 (None: as even as possible)"},
    {"flag": "--pipeline-trace", "default": None, "metavar": "FILE",
     "help": "pp dimension: write the measured per-rank timeline (JSON) here (None: no trace)"},
    {"flag": "--trace-steps", "type": "int", "range": "[0, inf)", "default": None, "metavar": "N",
     "help": "pp dimension: steps to record after the first (None: 3 with --pipeline-trace, else 0)"},
]
#: ``labkit advise --model gpt-*``'s mesh search (labkit.parallel.pricing): the pricing function below
ADVISOR = {"price": "labkit.parallel.pp:mesh_time"}

TRACE_SCHEMA = "labkit.pipeline-trace/1"


class Timeline:
    """Measured per-rank timeline of pipeline steps.

    Events are ``{"rank", "step", "kind", "mb", "start", "end"}`` with ``kind`` ``"F"`` / ``"B"`` (compute
    of micro-batch ``mb``) or ``"wait"`` (blocked on a send/receive handle; ``mb`` is None, ``label`` says
    which, e.g. ``fwd_recv``). Times are seconds since the step's origin: every rank of the ``pp`` column passes a
    barrier, then reads its clock, so ranks share the origin up to the barrier's exit skew (microseconds on one node).
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

    def event(self, kind: str, mb: int | None, start: float, end: float, label: str | None = None,
              stage: int | None = None) -> None:
        """Record one action of a schedule run from its data (:mod:`labkit.parallel.pp_runtime`): ``kind`` F, B, W,
        BW or wait, on ``stage``."""
        if self._step is not None:
            self._add(kind, mb, start, end, label)
            self.events[-1]["stage"] = stage

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
    def record(self, step: int, device: torch.device, params, group: dist.ProcessGroup | None = None):
        """Record step ``step``: align the clock with the other ranks of ``group`` (None: the world), time comm
        waits, meter memory."""
        dist.barrier(group=group)
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


class PipelineParallel(Dimension):
    """Stage ``rank`` of this ``pp`` column's ``size``-stage pipeline."""

    name = "pp"

    def __init__(self, mesh: DeviceMesh, options: dict):
        super().__init__(mesh, options)
        self.schedule_name, self.num_microbatches = pipeline_options(self.options, self.size)
        device = torch.device(mesh.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.trace_path = self.options.get("pipeline_trace")
        trace_steps = self.options.get("trace_steps")
        self.trace_steps = int(trace_steps if trace_steps is not None else (3 if self.trace_path else 0))
        self.timeline = Timeline(self.rank) if self.trace_steps > 0 and self.size > 1 else None
        self.virtual = chunks_of(self.options)
        self.stages = StageSchedules(self.rank, self.size, device, self.schedule_name, self.num_microbatches,
                                     group=self.group, timeline=self.timeline)
        self.runtime = None
        if self.options.get("pp_schedule") and self.size > 1:  # labkit's executor of the schedule as data
            self.runtime = ScheduleRuntime(self.rank, self.size, self.schedule_name, self.virtual,
                                           self.num_microbatches, device, group=self.group, timeline=self.timeline)
        self._steps = 0
        self.balance: list[int] | None = None
        self.embedding_group: dist.ProcessGroup | None = None
        self._tied_name: str | None = None
        self._tied: nn.Parameter | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Does this rank hold the last stage (rank P-1; under a V-shaped schedule, rank 0)?"""
        if self.runtime is not None:
            return self.runtime.holds(self.runtime.last_stage)
        return self.rank == self.size - 1

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        """A GPT of a named size is checked now (blocks >= stages, ``--balance`` summing to its blocks); a CNN's
        layers are counted when it is cut. Context parallelism is refused: its ranks hold tokens at other positions
        than 0..T/cp-1, given to the whole GPT's forward, and a stage computes its own positions. A mixture of
        experts is refused: its balancing loss would get the gradient 1 once per micro-batch while the task loss
        is divided by the number of micro-batches."""
        refuse_moe("pp", self.size, model_name, "the experts' balancing loss would count once per micro-batch "
                   "while the task loss is averaged over them")
        if self.size > 1 and (why := schedule_refusal(self.schedule_name, dist.get_backend(self.group))):
            raise ConfigError(why)
        if self.size > 1 and self.mesh.size(self.mesh.mesh_dim_names.index("cp")) > 1:
            raise ConfigError(f"--mesh pp={self.size} with cp > 1 is not supported: a pipeline stage computes the "
                              "positions itself, not cp's; use pp or cp")
        size = LANGUAGE_MODELS.get(model_name)
        if self.size > 1 and size is not None:
            self._balance(GPT_SIZES[size].n_layer, "blocks", model_name)

    def check_batch(self, batch_size: int) -> None:
        if self.size > 1:
            check_split(batch_size, self.num_microbatches)

    def _balance(self, num_units: int, unit: str, model_name: str = "the model") -> list[int]:
        """``--balance``, checked against ``num_units`` blocks or layers, or the even split; ``pp × --pp-virtual``
        stages, which must then divide the units (equal chunks, as the schedule's costs assume)."""
        cut = self.size * self.virtual
        given = self.options.get("balance")
        if given:
            return check_balance(given, num_units, [f"stage {i}" for i in range(cut)])
        if num_units < cut:
            chunks = f" × --pp-virtual {self.virtual} = {cut} chunks" if self.virtual > 1 else ""
            raise ConfigError(f"--mesh pp={self.size}{chunks}: {model_name} has {num_units} {unit}, fewer than the "
                              f"stages; use fewer")
        if self.virtual > 1 and num_units % cut:
            raise ConfigError(f"--mesh pp={self.size} × --pp-virtual {self.virtual} = {cut} chunks do not divide "
                              f"{model_name}'s {num_units} {unit}; choose v so that pp·v divides {num_units}, or give "
                              f"--balance with {cut} counts")
        return even_balance(num_units, cut)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """This rank's stage of ``model`` (a GPT, possibly tp-sharded, or an ``nn.Sequential``), on its device."""
        if self.size == 1:
            return model
        mine = self.runtime.schedule.stages_of(self.rank) if self.runtime is not None else [self.rank]
        if is_gpt(model):
            self.balance = self._balance(len(model.blocks), "blocks", "the GPT")
            tied = is_tied(model)
            parts = {s: GPTStage(model, self.balance, s) for s in mine}
            kind = f"GPT blocks {self.balance}" + (", tied embedding on the first and last stage" if tied else "")
        else:
            model = check_sequential(model)
            self.balance = self._balance(len(model), "layers", "the nn.Sequential")
            parts = {s: stage_layers(model, self.balance, s) for s in mine}
            kind, tied = f"layers {self.balance}", False
        stage = (RankStages(parts) if self.runtime is not None else parts[self.rank]).to(self.device)
        if tied:
            self._tie(parts)
        chunks = f" × {self.virtual} chunks" if self.virtual > 1 else ""
        print0(f"pp | {self.size} stages{chunks}, {kind} | schedule {self.schedule_name} | {self.num_microbatches} "
               "micro-batches")
        return stage

    def _embedding_groups(self) -> dist.ProcessGroup | None:
        """The {first, last} stage ranks of this rank's pp column (None on a middle stage); collective."""
        if self.size == 2:
            return self.group
        grid = self.mesh.mesh.movedim(self.mesh.mesh_dim_names.index("pp"), 0).reshape(self.size, -1)  # (P, cols)
        mine = None
        for column in grid.t().tolist():  # every rank creates every group, in the same order
            group = dist.new_group([column[0], column[-1]])
            if dist.get_rank() in (column[0], column[-1]):
                mine = group
        return mine

    def _tie(self, parts: dict[int, GPTStage]) -> None:
        """Make the embedding group; start the last stage's copy equal to the first's (broadcast once). Under a
        V-shaped schedule rank 0 holds the first and the last stage: the one matrix serves both, no group."""
        last = self.size * self.virtual - 1
        if self.runtime is not None and self.runtime.schedule.rank_of(last) == 0:
            return
        self.embedding_group = self._embedding_groups()
        weight = next((w for part in parts.values() if (w := part.tied_weight()) is not None), None)
        if weight is None:
            return
        self._tied_name = TIED["first" if self.is_first else "last"]
        first = dist.get_global_rank(self.embedding_group, 0)
        with torch.no_grad():
            kdist.broadcast(weight.data, src=first, group=self.embedding_group)

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One step's schedule over this column: ``(mean loss, outputs)`` on the last stage, ``(None, None)``
        elsewhere. ``model`` is what the later dimensions made of the stage (e.g. dp's wrapper). Steps
        ``1 .. --trace-steps`` are recorded on the timeline, if any."""
        step, self._steps = self._steps, self._steps + 1
        recording = self.timeline is not None and 1 <= step <= self.trace_steps
        context = self.timeline.record(step, self.device, model.parameters(), self.group) if recording else None
        if self.runtime is not None:
            with context or contextlib.nullcontext():
                return self.runtime.forward_backward(model.stages, x, y, criterion)
        return self.stages.forward_backward(model, x, y, criterion, context)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """Evaluation: the outputs on the last stage, None elsewhere."""
        if self.runtime is not None:
            return self.runtime.forward(model.stages, x)
        return self.stages.forward(model, x)

    def sync_gradients(self, model: nn.Module) -> None:
        """Sum the tied embedding's gradient over the embedding group (first and last stage); nothing else."""
        if self._tied_name is None:
            return
        if self._tied is None:  # found once, by name: dp may have wrapped or sharded the stage since the cut
            self._tied = next(p for name, p in model.named_parameters() if name.endswith(self._tied_name))
        grad = self._tied.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor under a sharded dp
        kdist.all_reduce(local, group=self.embedding_group)

    def owns_metrics(self) -> bool:
        return self.is_last

    def state_key(self) -> dict:
        return {"pp": self.size, "pp_balance": self.balance}

    def trace(self) -> dict | None:
        """Gather this column's timelines; the trace dict on its first stage (None elsewhere, and without a
        timeline). Collective over the ``pp`` group: all its ranks call."""
        if self.timeline is None:
            return None
        local = {"events": self.timeline.events, "memory": self.timeline.memory}
        gathered = [None] * self.size if self.is_first else None
        dist.gather_object(local, gathered, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if not self.is_first:
            return None
        return {"schema": TRACE_SCHEMA, "schedule": self.schedule_name, "num_stages": self.size,
                "virtual": self.virtual, "runtime": "labkit" if self.runtime is not None else "torch",
                "num_microbatches": self.num_microbatches, "balance": self.balance,
                "device": self.device.type, "backend": dist.get_backend(self.group),
                "steps": sorted({e["step"] for g in gathered for e in g["events"]}),
                "comm_recorded": self.timeline.comm_recorded,
                "events": [e for g in gathered for e in g["events"]],
                "memory": [m for g in gathered for m in g["memory"]]}

    def close(self) -> None:
        """Write the timeline (``--pipeline-trace``): gathered in every column, written by rank 0's."""
        trace = self.trace()
        if trace is not None and self.trace_path and dist.get_rank() == 0:
            atomic_write_text(Path(self.trace_path), json.dumps(trace) + "\n")
            print0(f"pipeline timeline written to {self.trace_path}")

    @staticmethod
    def price(batch: int, seq_len: int, n_embd: int, vocab_size: int, num_stages: int, tp: int = 1,
              sequence_parallel: bool = False, tied: bool = True, dtype_bytes: int = 4) -> dict:
        """Bytes one ``pp`` column sends per step (module docstring): ``{"activations", "embedding", "total"}``."""
        activations = 2 * (num_stages - 1) * batch * seq_len * n_embd * dtype_bytes
        if sequence_parallel:
            activations //= tp
        embedding = 2 * (vocab_size // tp) * n_embd * dtype_bytes if tied and num_stages > 1 else 0
        return {"activations": activations, "embedding": embedding, "total": activations + embedding}


@contextlib.contextmanager
def p2p_bytes_sent():
    """Count the bytes this rank's pipeline schedules send point-to-point inside the block (not the one-time
    shape exchange of a stage's first step): ``with p2p_bytes_sent() as sent: ...; sent["bytes"]``.

    Wraps the schedules module's ``_batch_p2p`` (a PyTorch internal, as :class:`Timeline` does); every send of a
    schedule goes through it.
    """
    schedules = torch_pipelining().schedules
    original, sent = schedules._batch_p2p, {"bytes": 0}

    def counted(ops, desc=None):
        sent["bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops, desc=desc)
    schedules._batch_p2p = counted
    try:
        yield sent
    finally:
        schedules._batch_p2p = original


def mesh_time(step) -> float:
    """A mesh step's ``pp`` term (:class:`labkit.parallel.pricing.MeshStep`), ``P`` stages of stride ``dp·cp·t``:

    ``pp = m·2·(α + β·a) + β·g``: each micro-batch's activation ``a`` at a stage boundary forward and its
    gradient back (:meth:`PipelineParallel.price`'s ``activations / (2(P − 1))``, ``/t`` with SP), and the
    tied embedding's gradient ``g`` between the first and last stage."""
    p, plan = step.plan.pp, step.plan
    if p == 1:
        return 0.0
    link = step.link(p, plan.dp * plan.cp * plan.tp)
    sent = PipelineParallel.price(step.b, step.tokens, step.gpt.n_embd, step.gpt.vocab_size, p, plan.tp,
                                  plan.sequence_parallel, True, step.e)
    return plan.microbatches * 2 * (link.alpha + link.beta * sent["activations"] / (2 * (p - 1))) + \
        sent["embedding"] * link.beta

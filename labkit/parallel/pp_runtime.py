"""Run a pipeline schedule written as data (:class:`labkit.parallel.pp_schedule.PipeSchedule`) on this rank's stages:
``labkit train --mesh pp=4 --pp-schedule zb-h1`` (or ``interleaved-1f1b --pp-virtual 2``, ``zbv``, ``dualpipev``).

    runtime = ScheduleRuntime(rank=1, ranks=4, name="zb-h1", chunks=1, microbatches=8, device=cpu, group=pp_group)
    loss, out = runtime.forward_backward(stages, x, y, criterion)   # stages: {stage index: module} of this rank

Each action of this rank's list runs in order (:meth:`PipeSchedule.with_comms` says where messages go):

* ``F`` (stage ``s``, micro-batch ``j``): the input is micro-batch ``j`` of the batch (stage 0) or the activation of
  stage ``s − 1`` (received from its rank, or kept here when that rank is this one); the output goes to stage
  ``s + 1`` the same way; the last stage computes the loss of ``j`` instead.
* ``BW``: the whole backward of ``(s, j)``: ``torch.autograd.backward`` from the output with the received
  gradient (the last stage: from ``loss_j / m``), the input's gradient sent to stage ``s − 1``.
* ``B`` and ``W`` (:class:`SplitBackward`): ``B`` asks autograd for the input's gradient only, and on the way for the
  gradient that reaches the output of every module that owns parameters (its *gradient edge*:
  ``torch.autograd.graph.get_gradient_edge``, recorded by a forward hook during ``F``); ``W`` later asks, module by
  module, for the parameters' gradients from those saved output gradients, so it runs only the weight half of each
  layer's backward (an ``nn.Linear``'s ``gᵀx``, never the ``g·W`` that ``B`` did). ``torch.distributed.pipelining``
  does the same job by walking the autograd graph (``stage_backward_input`` / ``stage_backward_weight``);
  B then W gives the ordinary backward's gradients (``tests/test_pp_runtime.py``).

Messages are ``isend`` / ``irecv`` with a tag per (activation or gradient, stage, micro-batch), so two messages between
the same ranks never swap. A receive is posted right before the action that needs it and waited on; sends are waited
on at the end of the step. The first activation of each (stage, micro-batch size) is preceded by its shape (8
integers: dtype code, rank, sizes), as ``PipelineStage`` exchanges shapes once; gradients have their activation's
shape, which the receiver knows. Both ends loop over the same data, so a schedule that passes the simulator
(:func:`labkit.parallel.pp_simulate.simulate`: every receive has its send, nothing waits on itself) cannot deadlock.

Gradients are scaled by ``1/m`` (each micro-batch's loss is its mean), so a step equals one step on the whole batch.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.pp_schedule import FORWARD, FULL, WEIGHT, Action, pipe_schedule

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_HEADER = 8


class SplitBackward:
    """Record, during forward, the gradient edge of every output of every module of ``modules`` that owns
    parameters; split a backward into :meth:`input_grad` (B) and :meth:`weight_grad` (W).

    A parameter is assumed to be used inside the forward of the module that owns it (true of every layer of the
    kit's models; a parent that reads a child's weight functionally would be missed, and the equality test would
    say so).
    """

    def __init__(self, modules: list[nn.Module]):
        self.owners = [m for root in modules for m in root.modules()
                       if any(p.requires_grad for p in m.parameters(recurse=False))]
        self._record: list | None = None
        for m in self.owners:
            m.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self._record is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            self._record.append((module, torch.autograd.graph.get_gradient_edge(output)))

    def forward(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        """``module(x)`` and the (module, output edge) pairs it made."""
        self._record = []
        try:
            return module(x), self._record
        finally:
            self._record = None

    @staticmethod
    def input_grad(output: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   edges: list) -> tuple[torch.Tensor | None, list]:
        """B: the gradient of ``inp`` (None when it needs none) and of every recorded module output, from
        ``output``'s gradient ``grad`` (None: ``output`` is the scaled loss). Keeps the graph for :meth:`weight_grad`."""
        wanted = ([inp] if inp is not None else []) + [e for _, e in edges]
        grads = torch.autograd.grad(output, wanted, grad_outputs=grad, retain_graph=True, allow_unused=True)
        if inp is not None:
            return grads[0], list(zip(edges, grads[1:]))
        return None, list(zip(edges, grads))

    @staticmethod
    def weight_grad(saved: list) -> None:
        """W: each module's parameter gradients from its output's gradient, added to ``.grad``."""
        for (module, edge), grad in saved:
            if grad is None:
                continue
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            for p, g in zip(params, torch.autograd.grad(edge, params, grad_outputs=grad, retain_graph=True,
                                                        allow_unused=True)):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)


def _tag(kind: str, stage: int, mb: int, m: int, header: bool = False) -> int:
    return ((stage * 2 + (kind == "grad")) * m + mb) * 2 + header


class ScheduleRuntime:
    """One rank's executor of the schedule ``name`` (:func:`labkit.parallel.pp_schedule.pipe_schedule`) over
    ``group`` (the ``pp`` group; None: the world, group ranks = global ranks). ``timeline``: a
    :class:`labkit.parallel.pp.Timeline` that records every action (None: not timed)."""

    def __init__(self, rank: int, ranks: int, name: str, chunks: int, microbatches: int, device: torch.device,
                 group: dist.ProcessGroup | None = None, timeline=None):
        self.rank, self.ranks, self.name, self.chunks = rank, ranks, name, chunks
        self.microbatches, self.device, self.group, self.timeline = microbatches, device, group, timeline
        self.schedule = pipe_schedule(name, ranks, microbatches, chunks)
        self._split: SplitBackward | None = None
        self._shapes: dict[tuple[int, int], tuple] = {}   # (stage, micro-batch size) -> received activation shape
        self._sent_shape: set[tuple[int, int]] = set()
        self._mb_size = 0                                  # samples per micro-batch of the step being run

    @property
    def last_stage(self) -> int:
        return self.schedule.num_stages - 1

    def holds(self, stage: int) -> bool:
        return self.schedule.rank_of(stage) == self.rank

    def _peer(self, stage: int) -> int:
        r = self.schedule.rank_of(stage)
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _send(self, tensor: torch.Tensor, kind: str, stage: int, mb: int, m: int, works: list) -> None:
        """Send ``tensor`` to the rank of ``stage`` (the receiving stage)."""
        peer, tensor = self._peer(stage), tensor.detach().contiguous()
        key = (stage, tensor.shape[0])
        if kind == "act" and key not in self._sent_shape:
            self._sent_shape.add(key)
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
            header = header.to(tensor.device)
            works.append((dist.isend(header, peer, group=self.group, tag=_tag(kind, stage, mb, m, True)), header))
        works.append((dist.isend(tensor, peer, group=self.group, tag=_tag(kind, stage, mb, m)), tensor))

    def _recv(self, kind: str, stage: int, mb: int, m: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """Receive the activation into ``stage`` (from ``stage − 1``) or the gradient of ``stage``'s output
        (from ``stage + 1``, shaped ``like``)."""
        peer = self._peer(stage - 1 if kind == "act" else stage + 1)
        start = time.perf_counter()
        if kind == "act":
            key = (stage, self._mb_size)
            if key not in self._shapes:
                header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
                dist.irecv(header, peer, group=self.group, tag=_tag(kind, stage, mb, m, True)).wait()
                header = header.tolist()
                self._shapes[key] = (_DTYPES[header[0]], tuple(header[2:2 + header[1]]))
            dtype, shape = self._shapes[key]
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
        else:
            buffer = torch.empty_like(like)
        dist.irecv(buffer, peer, group=self.group, tag=_tag(kind, stage, mb, m)).wait()
        if self.timeline is not None:
            self.timeline.event("wait", mb, start, time.perf_counter(), label=f"{kind}_recv", stage=stage)
        return buffer

    def forward_backward(self, stages: dict[int, nn.Module], x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One training step of the schedule: ``(mean loss, outputs)`` on the rank of the last stage, ``(None,
        None)`` elsewhere. Gradients are added to ``.grad`` (as ``backward()`` does)."""
        m = self.microbatches
        if len(x) % m:
            raise ConfigError(f"batch of {len(x)} samples does not split into {m} equal micro-batches; choose "
                              "--batch-size divisible by --num-microbatches")
        if self._split is None:
            self._split = SplitBackward(list(stages.values()))
        xs, ys = x.chunk(m), y.chunk(m)
        self._mb_size = len(xs[0])
        acts: dict[tuple[int, int], torch.Tensor] = {}   # activations / gradients handed between stages of this rank
        grads: dict[tuple[int, int], torch.Tensor] = {}
        held: dict[tuple[int, int], tuple] = {}          # (stage, mb) -> (input, output, edges) from F to B/BW
        saved: dict[tuple[int, int], list] = {}          # (stage, mb) -> (edge, grad) pairs from B to W
        losses: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        works: list = []
        for action in self.schedule.actions[self.rank]:
            start = self._run(action, stages, xs, ys, criterion, m, acts, grads, held, saved, losses, outputs, works)
            if self.timeline is not None:  # the compute alone: a receive's wait is its own event
                self.timeline.event(action.kind, action.mb, start, time.perf_counter(), stage=action.stage)
        for work, _ in works:
            work.wait()
        if not self.holds(self.last_stage):
            return None, None
        loss = torch.stack([losses[j] for j in range(m)]).mean().detach()
        return loss, torch.cat([outputs[j] for j in range(m)])

    def _run(self, a: Action, stages, xs, ys, criterion, m, acts, grads, held, saved, losses, outputs,
             works) -> float:
        """Run one action (its receive first); returns when its compute started."""
        s, j = a.stage, a.mb
        if a.kind == FORWARD:
            if s == 0:
                inp = xs[j]
            elif self.holds(s - 1):
                inp = acts.pop((s, j))
            else:
                inp = self._recv("act", s, j, m)
            if s > 0:
                inp = inp.detach().requires_grad_(inp.is_floating_point())
            start = time.perf_counter()
            out, edges = self._split.forward(stages[s], inp)
            if s == self.last_stage:
                loss = criterion(out, ys[j])
                losses[j], outputs[j] = loss.detach(), out.detach()
                out = loss / m
            elif self.holds(s + 1):
                acts[(s + 1, j)] = out.detach()
            else:
                self._send(out, "act", s + 1, j, m, works)
            held[(s, j)] = (inp if s > 0 and inp.requires_grad else None, out, edges)
            return start
        if a.kind == WEIGHT:
            start = time.perf_counter()
            SplitBackward.weight_grad(saved.pop((s, j)))
            return start
        inp, out, edges = held.pop((s, j))
        if s == self.last_stage:
            grad = None
        elif self.holds(s + 1):
            grad = grads.pop((s, j))
        else:
            grad = self._recv("grad", s, j, m, like=out)
        start = time.perf_counter()
        if a.kind == FULL:  # one pass: the input is a leaf of this stage's graph, so its .grad is the gradient to send
            torch.autograd.backward(out, grad_tensors=grad)
            dinp = inp.grad if inp is not None else None
        else:
            dinp, saved[(s, j)] = SplitBackward.input_grad(out, grad, inp, edges)
        if inp is not None:
            if self.holds(s - 1):
                grads[(s - 1, j)] = dinp
            else:
                self._send(dinp, "grad", s - 1, j, m, works)
        return start

    def forward(self, stages: dict[int, nn.Module], x: torch.Tensor) -> torch.Tensor | None:
        """Evaluation: the whole batch as one micro-batch through this rank's stages in order; the outputs on the
        rank of the last stage, None elsewhere."""
        works: list = []
        self._mb_size = len(x)
        out = None
        with torch.no_grad():
            for s in sorted(stages):
                inp = x if s == 0 else out if self.holds(s - 1) and out is not None else self._recv("act", s, 0, 1)
                out = stages[s](inp)
                if s < self.last_stage and not self.holds(s + 1):
                    self._send(out, "act", s + 1, 0, 1, works)
                    out = None
        for work, _ in works:
            work.wait()
        return out if self.holds(self.last_stage) else None


class RankStages(nn.Module):
    """The stages one rank holds (``{stage index: module}``, :attr:`stages`) as one module whose parameters keep the
    whole model's names (``blocks.5.attn...``, ``fc1.weight``): each stage's children are registered here under their
    own names, a GPT's ``blocks`` merged into one ``ModuleDict``. A parameter shared by two of them (the tied
    embedding when one rank holds the first and the last stage) is one parameter. It is not called: the schedule runs
    :attr:`stages` (:meth:`ScheduleRuntime.forward_backward`)."""

    def __init__(self, stages: dict[int, nn.Module]):
        super().__init__()
        for stage in stages.values():
            for name, child in stage.named_children():
                if isinstance(child, nn.ModuleDict):
                    if name not in self._modules:
                        self.add_module(name, nn.ModuleDict())
                    self._modules[name].update(child)
                else:
                    self.add_module(name, child)
        self.__dict__["stages"] = dict(sorted(stages.items()))  # the same modules, not registered twice

    def forward(self, *args, **kwargs):
        raise RuntimeError("RankStages is run by its schedule (ScheduleRuntime), not called")

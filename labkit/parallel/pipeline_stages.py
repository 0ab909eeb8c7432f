"""The pieces of a multi-process pipeline that every form of it shares: cutting a model into stages and
running one stage's ``torch.distributed.pipelining`` schedule.

Used by the mesh's ``pp`` dimension (:mod:`labkit.parallel.pp`: one stage per rank of each ``pp`` group), and so by
its preset ``--strategy pipeline`` (:mod:`labkit.parallel.pipelining`: ``--mesh pp=<ranks>``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from labkit.errors import ConfigError
from labkit.parallel.pp_schedule import check_schedule, chunks_of
from labkit.strategies.gpipe import check_chunks, num_microbatches

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def torch_pipelining():
    """torch.distributed.pipelining, imported on first use: it costs seconds, and a process that only
    reads the pipeline's flags or helpers should not pay them."""
    import torch.distributed.pipelining as pipelining
    import torch.distributed.pipelining.schedules  # noqa: F401  (the module whose p2p helpers are timed)

    return pipelining


def schedule_refusal(schedule: str, backend: str) -> str | None:
    """Why ``schedule`` cannot run on ``backend``'s ranks with this torch (one line), or None. Up to torch 2.7 a
    schedule waits for only the last operation of each batch of sends and receives: enough under NCCL, which
    coalesces the batch, but torch 2.6's 1F1B hangs on two gloo ranks; torch 2.8 waits for each
    (``schedules._wait_batch_p2p``)."""
    if schedule == "1f1b" and backend == "gloo" and not hasattr(torch_pipelining().schedules, "_wait_batch_p2p"):
        return (f"--schedule 1f1b on gloo ranks needs torch 2.8 or later (before it, the schedule waits for only the "
                f"last of each batch of sends and receives, and 1F1B hangs on gloo), this is torch "
                f"{torch.__version__}; use --schedule gpipe, or GPUs (NCCL)")
    return None


def pipeline_options(options: dict, stages: int, on_mesh: bool = True) -> tuple[str, int]:
    """``(schedule, micro-batches)`` of a ``stages``-stage pipeline, its options checked once for every form of it:
    the mesh's ``pp`` (``on_mesh``: the messages say ``pp=P``) and ``--strategy pipeline`` (they say ranks).
    ``schedule`` is ``--pp-schedule`` when given (run by :mod:`labkit.parallel.pp_runtime` from its data), else
    ``--schedule`` (run by ``torch.distributed.pipelining``).

    Raises:
        ConfigError: an unknown ``--schedule``; 1F1B with fewer micro-batches than stages (its warm-up would
            have nothing to run); ``--pp-schedule`` with ``--schedule 1f1b``, ``--pp-virtual`` without
            ``--pp-schedule``, or what the schedule cannot run (:func:`labkit.parallel.pp_schedule.check_schedule`:
            too few micro-batches, a chunk count it does not take); a ``--balance`` with a count per stage
            (per chunk, ``pp × --pp-virtual`` of them) missing or extra; ``--pp-schedule`` with ``--dp-shard zero3``
            or ``fsdp``.
    """
    schedule = options.get("schedule") or "gpipe"
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    chunks = num_microbatches(options)
    count = f"pp={stages}" if on_mesh else stages
    named, virtual = options.get("pp_schedule"), options.get("pp_virtual")
    if named is None and virtual is not None:
        raise ConfigError(f"--pp-virtual {virtual} needs --pp-schedule (interleaved-1f1b takes any v >= 2, zbv and "
                          "dualpipev take 2)")
    if named is not None:
        if schedule != "gpipe":
            raise ConfigError(f"--pp-schedule {named} and --schedule {schedule} both name the schedule; give one")
        if options.get("dp_shard") in ("zero3", "fsdp"):
            raise ConfigError(f"--pp-schedule {named} with --dp-shard {options['dp_shard']}: the split backward "
                              "writes .grad itself, which sharded parameters do not take; use --dp-shard none, "
                              "zero1 or zero2")
        virtual = chunks_of(options)
        check_schedule(named, stages, chunks, virtual)
        schedule = named
    elif stages > 1 and schedule == "1f1b" and chunks < stages:
        raise ConfigError(f"--schedule 1f1b needs --num-microbatches >= the number of stages ({count}), got {chunks}")
    cut = stages * (virtual or 1)
    given = options.get("balance")
    if stages > 1 and given and len(given) != cut:
        there = f"pp={stages}" if on_mesh else f"there are {stages} ranks"
        per = f" × --pp-virtual {virtual} = {cut} chunks" if (virtual or 1) > 1 else ""
        raise ConfigError(f"--balance {' '.join(map(str, given))} gives {len(given)} stage(s) but {there}{per}; "
                          "give one count per stage")
    return schedule, chunks


def even_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts as equal as possible, earlier stages taking the remainder: ``(7, 3) -> [3, 2, 2]``."""
    if num_stages > num_layers:
        raise ConfigError(f"{num_stages} stages but the model has only {num_layers} layers; use fewer ranks")
    base, extra = divmod(num_layers, num_stages)
    return [base + (i < extra) for i in range(num_stages)]


def stage_layers(model: nn.Sequential, balance: list[int], stage: int) -> nn.Sequential:
    """The layers of ``stage``: ``model[sum(balance[:stage]) : sum(balance[:stage + 1])]`` (same objects)."""
    start = sum(balance[:stage])
    return model[start:start + balance[stage]]


def microbatches_for(batch: int, wanted: int, minimum: int = 1) -> int | None:
    """Largest ``m <= wanted`` with ``batch % m == 0`` and ``m >= minimum``, or None."""
    return next((m for m in range(min(wanted, batch), minimum - 1, -1) if batch % m == 0), None)


def check_split(batch: int, num_microbatches: int) -> None:
    """A full batch of ``batch`` samples splits into ``num_microbatches`` equal micro-batches of >= 1 sample."""
    check_chunks(num_microbatches, batch)
    if batch % num_microbatches:
        raise ConfigError(f"batch of {batch} samples does not split into {num_microbatches} equal "
                          "micro-batches; choose --batch-size divisible by --num-microbatches")

class StageSchedules:
    """One pipeline stage's schedules: stage ``index`` of ``num_stages`` over ``group`` (None: the world).

    A schedule is built on first use for each batch size, around the module it is given then (a data-parallel
    wrapper of the stage, if one was applied after the cut): stages have fixed shapes. A smaller last batch
    uses the largest ``m <= M`` micro-batches that divides it (1F1B needs ``m >= num_stages``, else GPipe).
    Run by the mesh's ``pp`` dimension (and its preset ``--strategy pipeline``). ``timeline``: a
    :class:`~labkit.parallel.pp.Timeline` that times every forward and backward (None: not timed).
    """

    def __init__(self, index: int, num_stages: int, device: torch.device, schedule: str, num_microbatches: int,
                 group: dist.ProcessGroup | None = None, timeline=None):
        self.index, self.num_stages, self.device, self.group = index, num_stages, device, group
        self.schedule_name, self.num_microbatches, self.timeline = schedule, num_microbatches, timeline
        self._schedules: dict[tuple[int, bool], tuple] = {}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def schedule(self, model: nn.Module, batch: int, train: bool, criterion: nn.Module | None):
        """The (schedule, micro-batches) for this batch size, built once per size."""
        key = (batch, train)
        if key not in self._schedules:
            pp = torch_pipelining()
            cls = pp.Schedule1F1B if train and self.schedule_name == "1f1b" else pp.ScheduleGPipe
            if not train:
                m = 1
            elif not any(is_train for _, is_train in self._schedules):
                check_split(batch, self.num_microbatches)
                m = self.num_microbatches
            else:  # a smaller last batch
                m = microbatches_for(batch, self.num_microbatches, self.num_stages if cls is pp.Schedule1F1B else 1)
                if m is None:
                    cls, m = pp.ScheduleGPipe, microbatches_for(batch, self.num_microbatches)
            stage = pp.PipelineStage(model, self.index, self.num_stages, self.device, group=self.group)
            if self.timeline is not None and train:
                self.timeline.instrument(stage)
            self._schedules[key] = (cls(stage, m, loss_fn=criterion if train else None), m)
        return self._schedules[key]

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, criterion: nn.Module,
                         context=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one training step's schedule (inside ``context``, e.g. a :meth:`Timeline.record`); the last stage
        returns ``(mean loss, outputs)``, the others ``(None, None)``."""
        if not self._schedules:
            check_chunks(self.num_microbatches, len(x))
        schedule, m = self.schedule(model, len(x), True, criterion)
        losses: list[torch.Tensor] = []
        with context or contextlib.nullcontext():
            if self.is_first:
                out = schedule.step(x)
            elif self.is_last:
                out = schedule.step(target=y, losses=losses)
            else:
                out = schedule.step()
        if not hasattr(schedule, "scale_grads"):
            # torch 2.6 leaves the stage's gradients summed over the m micro-batches (each loss a micro-batch mean);
            # from 2.7 on the schedule divides them by m itself (scale_grads): the mean over the whole batch
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(m)
        if not self.is_last:
            return None, None
        return torch.stack(losses).mean().detach(), out.detach()  # equal micro-batches: mean of means

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """Evaluation: the whole batch as one micro-batch; the outputs on the last stage, None elsewhere."""
        schedule, _ = self.schedule(model, len(x), False, None)
        # Schedule.eval (torch 2.9) runs the forward only; before it, step() does just that on a schedule built
        # without a loss function
        forward = schedule.eval if hasattr(schedule, "eval") else schedule.step
        out = forward(x) if self.is_first else forward()
        return out if self.is_last else None

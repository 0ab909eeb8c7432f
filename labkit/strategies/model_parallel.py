"""Model parallelism inside one process: cut an ``nn.Sequential`` into stages, one per device.

Each layer lives on one device; activations move forward across the cut and their gradients move back.
On its own that leaves every device but one idle at any moment ("each layer needs to wait for the
output of the previous layer"). *Pipelined inputs* split each batch into micro-batches of
``split_size`` samples so device j+1 works on micro-batch i while device j starts micro-batch i+1 (CUDA
kernels launch asynchronously; one thread drives every device). On a CPU-only machine every "device"
is the CPU: the code runs and computes the same numbers, but nothing overlaps, so there is no speed-up.

    labkit train --strategy model-parallel --mp-devices 2 --mp-split-size 16 --model alexnet_small \\
        --dataset cifar10                                   # 1 node, 2 GPUs, one process
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labkit.errors import CheckpointError, ConfigError
from labkit.strategies.base import Strategy
from labkit.strategies.stage_balance import _check_stages, balance_by_params, balance_by_time, balance_from_split_points


@dataclass(frozen=True)
class BusyInterval:
    """Stage ``stage`` on ``device`` worked on micro-batch ``micro_batch`` from ``start`` to ``end``
    (seconds since the step began); ``phase`` is ``"forward"`` or ``"backward"``."""

    stage: int
    device: str
    micro_batch: int
    phase: str
    start: float
    end: float


class _Clock:
    """Timestamps: CUDA events on GPUs (they time the device, not the launching thread), else the host clock."""

    def __init__(self, devices: Sequence[torch.device]):
        self.cuda = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
        for d in self.cuda:
            torch.cuda.synchronize(d)
        self.origin = {d: self.stamp(d) for d in self.cuda}
        self.host_origin = time.perf_counter()
        self.marks: dict[tuple[int, int, str], dict[str, tuple[torch.device, object]]] = {}

    def stamp(self, device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def mark(self, key: tuple[int, int, str], edge: str, device: torch.device) -> None:
        self.marks.setdefault(key, {})[edge] = (device, self.stamp(device))

    def seconds(self, device: torch.device, stamp) -> float:
        if device.type != "cuda":
            return stamp - self.host_origin
        return self.origin[device].elapsed_time(stamp) / 1000

    def intervals(self) -> list[BusyInterval]:
        for d in self.cuda:
            torch.cuda.synchronize(d)
        out = []
        for (stage, mb, phase), edges in self.marks.items():
            if "start" in edges and "end" in edges:
                (dev, s), (_, e) = edges["start"], edges["end"]
                out.append(BusyInterval(stage, str(dev), mb, phase, self.seconds(dev, s), self.seconds(dev, e)))
        return sorted(out, key=lambda iv: (iv.start, iv.stage))


class _Mark(torch.autograd.Function):
    """Identity whose backward stamps the clock: the moment a gradient passes this point."""

    @staticmethod
    def forward(ctx, x, anchor, clock, key, edge, device):
        ctx.args = clock, key, edge, device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        clock, key, edge, device = ctx.args
        clock.mark(key, edge, device)
        return grad, None, None, None, None, None


class ModelParallel(nn.Module):
    """An ``nn.Sequential`` spread over ``devices``, optionally with pipelined micro-batches.

    Args:
        model: the flat model; its layers are moved to their stage's device in place.
        devices: one per stage (repeats allowed, e.g. ``["cpu", "cpu"]``).
        balance: layers per stage (e.g. ``[5, 4]``), or ``"params"`` (balance parameter counts) or
            ``"time"`` (measured on the first batch).
        split_size: micro-batch size for pipelined inputs; ``None`` runs each batch whole.
        record: keep each step's per-stage busy intervals (read them with :meth:`timeline`); to stamp the
            end of stage 0's backward, stage 0 then also computes the gradient w.r.t. its input (a little
            extra work while recording).

    Shapes: x (B, ...) on ``devices[0]`` -> (B, num_classes) on ``devices[-1]``. The output and its
    gradients equal the single-device model's (BatchNorm excepted: it would see micro-batch statistics).
    """

    def __init__(self, model: nn.Sequential, devices: Sequence[torch.device | str],
                 balance: Sequence[int] | str = "params", split_size: int | None = None, record: bool = False):
        super().__init__()
        if not isinstance(model, nn.Sequential):
            raise ConfigError(f"model parallelism cuts an nn.Sequential, got {type(model).__name__}; "
                              "build it with get_model(..., sequential=True)")
        if split_size is not None and split_size <= 0:
            raise ConfigError(f"--mp-split-size must be > 0 (or omitted), got {split_size}")
        self.module = model
        self.devices = [torch.device(d) for d in devices]
        _check_stages(len(model), len(self.devices))
        self.split_size, self.record = split_size, record
        self.balance: list[int] | None = None
        self._stages: list[nn.Sequential] = []
        self._clock: _Clock | None = None
        if balance == "params":
            balance = balance_by_params(model, len(self.devices))
        elif isinstance(balance, str) and balance != "time":
            raise ConfigError(f"unknown balance {balance!r}; use params, time or a list of layer counts")
        if balance != "time":
            self.place(list(balance))

    def place(self, balance: list[int]) -> None:
        """Move ``balance[j]`` layers to stage j's device (``balance="time"``: on the first batch, or on resume)."""
        n, k = len(self.module), len(self.devices)
        if len(balance) != k or any(b < 1 for b in balance) or sum(balance) != n:
            raise ConfigError(f"balance {balance} must give each of the {k} devices >= 1 layer and sum to "
                              f"the {n} layers of the model")
        bounds = [0, *itertools.accumulate(balance)]
        self._stages = [nn.Sequential(*self.module[a:b]).to(d) for a, b, d in zip(bounds, bounds[1:], self.devices)]
        self.balance = balance

    def _run_stage(self, j: int, i: int, x: torch.Tensor) -> torch.Tensor:
        device = self.devices[j]
        x = x.to(device, non_blocking=True)
        if self._clock is None:
            return self._stages[j](x)
        key = (j, i, "backward")
        # the anchor makes the stage-0 input require grad, so its backward end is stamped too
        anchor = torch.ones((), device=device, requires_grad=j == 0 and torch.is_grad_enabled())
        x = _Mark.apply(x, anchor, self._clock, key, "end", device)
        self._clock.mark((j, i, "forward"), "start", device)
        y = self._stages[j](x)
        self._clock.mark((j, i, "forward"), "end", device)
        return _Mark.apply(y, None, self._clock, key, "start", device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.balance is None:
            self.place(balance_by_time(self.module, x, len(self.devices)))
        self._clock = _Clock(self.devices) if self.record else None
        acts = list(x.split(self.split_size)) if self.split_size else [x]
        m, k = len(acts), len(self._stages)
        # clock tick t: stage j takes micro-batch t - j, which stage j-1 finished at tick t-1; the later
        # stages are issued first so stage 0's next micro-batch queues behind nothing on its device
        for t in range(m + k - 1):
            for j in reversed(range(k)):
                if 0 <= t - j < m:
                    acts[t - j] = self._run_stage(j, t - j, acts[t - j])
        return torch.cat(acts)  # (B, num_classes) on devices[-1]

    def timeline(self) -> list[BusyInterval]:
        """Busy intervals of the last recorded step (call after its backward), sorted by start."""
        if self._clock is None:
            raise RuntimeError("nothing recorded: build ModelParallel(..., record=True) and run a step first")
        return self._clock.intervals()


def project_on_separate_devices(intervals: Sequence[BusyInterval]) -> list[BusyInterval]:
    """Replay measured durations as if each stage had its own device and transfers were free.

    Forward: stage j starts micro-batch i when stage j-1 finished it and stage j finished i-1.
    Backward starts when every forward is done (the loss needs the whole batch) and, as autograd does,
    takes the micro-batches last-first. On a CPU run this shows what GPUs would overlap.
    """
    dur = {(iv.stage, iv.micro_batch, iv.phase): iv.end - iv.start for iv in intervals}
    device = {iv.stage: iv.device for iv in intervals}
    k, m = max(device) + 1, 1 + max(iv.micro_batch for iv in intervals)
    end: dict[tuple[int, int, str], float] = {}
    out = []

    def put(j, i, phase, start):
        end[j, i, phase] = start + dur.get((j, i, phase), 0.0)
        out.append(BusyInterval(j, device[j], i, phase, start, end[j, i, phase]))

    for i in range(m):
        for j in range(k):
            put(j, i, "forward", max(end.get((j - 1, i, "forward"), 0.0), end.get((j, i - 1, "forward"), 0.0)))
    if any(p == "backward" for *_, p in dur):
        free = {j: max(end.values()) for j in range(k)}
        for i in reversed(range(m)):
            for j in reversed(range(k)):
                put(j, i, "backward", max(end.get((j + 1, i, "backward"), 0.0), free[j]))
                free[j] = end[j, i, "backward"]
    return sorted(out, key=lambda iv: (iv.start, iv.stage))


#: ``labkit train --strategy model-parallel`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--mp-devices", "type": "int", "range": "[1, inf)", "default": 2,
     "help": "devices (stages) to split the model over"},
    {"flag": "--mp-split-points", "type": "int", "range": "[1, inf)", "nargs": "+", "default": None, "metavar": "LAYER",
     "help": "cut before these layer indices (overrides --mp-balance-by)"},
    {"flag": "--mp-balance-by", "default": "params", "choices": ["params", "time"],
     "help": "balance stages by parameter count or by measured time"},
    {"flag": "--mp-split-size", "type": "int", "range": "[1, inf)", "default": None, "metavar": "N",
     "help": "pipelined inputs: micro-batches of N samples (None: the whole batch)"},
]
#: ``labkit advise``: one process, ``k`` devices, one batch (labkit.advisor.search)
ADVISOR = {"price": "labkit.strategies.gpipe:price_one_process_pipeline", "plans": "pipeline", "processes": "one",
           "options": {"split_points": "mp_split_points"}}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 1, "flags": ["--mp-devices", "2"]}

class ModelParallelStrategy(Strategy):
    """One process drives ``--mp-devices`` devices; the loop puts inputs on the first, targets on the last."""

    name = "model-parallel"
    sequential_model = True

    def __init__(self, env, options=None):
        super().__init__(env, options)
        if env.world_size > 1:
            raise ConfigError("model-parallel drives several devices from ONE process; start it with plain "
                              f"`labkit train`, not {env.world_size} ranks (use ddp/hybrid for several ranks)")
        points = self.options.get("mp_split_points")
        k = len(points) + 1 if points else self.options.get("mp_devices", 2)
        if k < 1:
            raise ConfigError(f"--mp-devices must be >= 1, got {k}")
        if env.device.type == "cuda":
            count = torch.cuda.device_count()
            if k > count:
                raise ConfigError(f"--mp-devices {k} needs {k} GPUs but this node has {count}; use "
                                  f"--mp-devices {count} or --device cpu")
            self._devices = [torch.device("cuda", i) for i in range(k)]
        else:
            self._devices = [env.device] * k

    @property
    def input_device(self) -> torch.device:
        return self._devices[0]

    @property
    def target_device(self) -> torch.device:
        return self._devices[-1]

    def prepare(self, model: nn.Module) -> nn.Module:
        points = self.options.get("mp_split_points")
        balance = (balance_from_split_points(len(model), points) if points and isinstance(model, nn.Sequential)
                   else self.options.get("mp_balance_by") or "params")
        return ModelParallel(model, self._devices, balance, self.options.get("mp_split_size"))

    def placement(self, model: nn.Module) -> dict:
        return {"balance": list(model.balance)} if model.balance else {}

    def place(self, model: nn.Module, state: dict) -> None:
        """Balanced by time, the stages are cut on the first batch: cut them now, as the checkpointed run did."""
        if model.balance is None:
            if not state.get("balance"):
                raise CheckpointError("it does not say how the layers were split (no balance); resume with "
                                      "--mp-split-points, or start without --resume")
            model.place([int(b) for b in state["balance"]])

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self._devices))

"""GPipe in one process: an ``nn.Sequential`` cut into partitions on several devices, and every mini-batch
cut into micro-batches that flow through the partitions like work through a pipeline (``torchgpipe``).

    labkit train --strategy gpipe --model resnet50 --dataset mnist --batch-size 512 \\
        --partitions 2 --balance-by time --num-microbatches 8 --checkpoint-mode except_last

With ``P`` partitions and ``M`` micro-batches, a fill-and-drain step keeps each device idle for a fraction
``(P - 1) / (M + P - 1)`` of the step (the *bubble*); more micro-batches shrink it, but each one is smaller
and so less efficient on a GPU. Checkpointing keeps only each partition's input per micro-batch and
recomputes the rest during backward: peak activation memory drops from ``O(B)`` to ``O(B / M)`` per layer
at the cost of one more forward.

How the partitions are chosen (``--balance`` by hand, otherwise measured on the first training batch):

* ``time``: forward + backward of every layer on one micro-batch, timed by torchgpipe's profiler (what
  ``torchgpipe.balance.balance_by_time`` does, plus one uncounted warm-up pass); the layers are split so
  the partitions' sums are as equal as possible.
* ``memory``: on CUDA torchgpipe's allocation profiler (what ``balance_by_size`` does, parameters × 2 +
  activations). On CPU, where that needs CUDA, :func:`~labkit.strategies.balance.estimate_layer_memory`:
  parameter bytes × 2 + the bytes autograd saves for backward while the layer runs one micro-batch (counted
  with saved-tensor hooks).

torchgpipe defaults to every CUDA device; labkit always passes ``devices`` (``P × cpu`` on CPU, where the
partitions run one after another: a correct pipeline, but no overlap). On CPU the tasks of labkit's pipelines
(an :class:`~labkit.strategies.gpipe_workers.InlineGPipe`) run on the calling thread rather than on worker
threads torchgpipe starts in every forward (a fresh thread's start-up made GPipe on CPU 1.3–2.2× slower than
the same micro-batches run plainly); a plain ``torchgpipe.GPipe`` keeps torchgpipe's worker threads.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torchgpipe import GPipe

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import common_terms, compute_scale, memory_terms, message_time, pipeline_terms, stages_of
from labkit.dist.group import DistEnv, print0
from labkit.errors import CheckpointError, ConfigError
from labkit.strategies.balance import compute_balance
from labkit.strategies.base import Strategy
from labkit.strategies.gpipe_workers import InlineGPipe
from labkit.strategies.stage_balance import balance_from_split_points

CHECKPOINT_MODES = ("always", "except_last", "never")

#: ``labkit train --strategy gpipe`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--num-microbatches", "type": "int", "range": "[1, inf)", "default": 4, "metavar": "M",
     "help": "micro-batches per mini-batch"},
    {"flag": "--partitions", "type": "int", "range": "[1, inf)", "default": None, "metavar": "P",
     "help": "partitions (None: every GPU, or 2 on CPU; or as many as --balance gives)"},
    {"flag": "--balance", "type": "int", "range": "[1, inf)", "nargs": "+", "default": None, "metavar": "N",
     "help": "layers per partition, e.g. --balance 10 12 (None: measured, see --balance-by)"},
    {"flag": "--balance-by", "choices": ["time", "memory"], "default": "time",
     "help": "measure the split on the first batch by time or memory"},
    {"flag": "--checkpoint-mode", "choices": ["always", "except_last", "never"], "default": "except_last",
     "help": "recompute activations in backward"},
]
#: ``labkit advise``: one process drives ``k`` partitions, ``m`` micro-batches (labkit.advisor.search)
ADVISOR = {"price": "labkit.strategies.gpipe:price_one_process_pipeline", "plans": "pipeline", "processes": "one",
           "options": {"microbatches": "num_microbatches", "stages": "partitions", "balance": "balance"}}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 1, "flags": ["--partitions", "2", "--num-microbatches", "4"]}


def check_sequential(model: nn.Module) -> nn.Sequential:
    """Return ``model`` if it is an ``nn.Sequential`` that can be cut into partitions, else raise."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"pipelining cuts an nn.Sequential into partitions, got {type(model).__name__}; build it "
                          "with labkit.models.cnn.get_model(name, sequential=True) or list its layers in nn.Sequential")
    return model


def num_microbatches(options: dict, default: int = 4) -> int:
    """``--num-microbatches`` (``default`` when not given), validated and written back into ``options`` so the
    recorded configuration says what ran."""
    given = options.get("num_microbatches")
    chunks = default if given is None else int(given)
    check_chunks(chunks, chunks)
    options["num_microbatches"] = chunks
    return chunks


def check_chunks(chunks: int, batch_size: int) -> None:
    """Every micro-batch needs at least one sample: ``1 <= chunks <= batch_size``."""
    if chunks < 1:
        raise ConfigError(f"--num-microbatches must be >= 1, got {chunks}")
    if chunks > batch_size:
        raise ConfigError(f"--num-microbatches {chunks} is larger than the batch ({batch_size} samples); every "
                          f"micro-batch needs a sample: use --num-microbatches <= {batch_size} or a larger batch")


def check_balance(balance: Sequence[int], num_layers: int, devices: Sequence) -> list[int]:
    """``balance[i]`` layers go to partition ``i``: positive, summing to the layer count, one device each."""
    balance = [int(b) for b in balance]
    if not balance or any(b <= 0 for b in balance):
        raise ConfigError(f"--balance {' '.join(map(str, balance))}: every partition needs >= 1 layer")
    if sum(balance) != num_layers:
        raise ConfigError(f"--balance {' '.join(map(str, balance))} sums to {sum(balance)} but the model has "
                          f"{num_layers} layers; give layer counts that add up to {num_layers}")
    if len(balance) > len(devices):
        raise ConfigError(f"{len(balance)} partitions but only {len(devices)} device(s) "
                          f"({', '.join(map(str, devices))}); use at most {len(devices)} partitions or add devices")
    return balance


def gpipe_devices(partitions: int | None, device: torch.device) -> list[torch.device]:
    """``cuda:0 .. cuda:P-1`` on a GPU node (default: every GPU), ``P × cpu`` on CPU (default 2)."""
    if device.type == "cuda":
        available = torch.cuda.device_count()
        partitions = partitions or available
        if partitions > available:
            raise ConfigError(f"--partitions {partitions} needs {partitions} GPUs but this node has {available}; "
                              f"use --partitions <= {available}")
        return [torch.device("cuda", i) for i in range(partitions)]
    partitions = partitions or 2
    if partitions < 1:
        raise ConfigError(f"--partitions must be >= 1, got {partitions}")
    return [torch.device("cpu")] * partitions


def make_gpipe(model: nn.Module, devices: Sequence[str | torch.device], chunks: int = 4,
               checkpoint: str = "except_last", balance: Sequence[int] | None = None, balance_by: str = "time",
               sample: torch.Tensor | None = None, profile_seconds: float = 1.0) -> GPipe:
    """Validate the configuration and wrap ``model`` in a ``torchgpipe.GPipe`` (an ``InlineGPipe``: on CPU its
    tasks run on the calling thread).

    Args:
        model: an ``nn.Sequential``; its layers (same parameter objects) move to their partitions' devices.
        devices: one device per partition (``["cuda:0", "cuda:1"]``, or ``["cpu", "cpu"]``).
        chunks: micro-batches per mini-batch.
        checkpoint: ``always`` | ``except_last`` | ``never`` (recompute activations during backward).
        balance: layers per partition; ``None`` measures it on ``sample`` by ``balance_by``.
        sample: a mini-batch ``(B, C, H, W)`` for balancing and the micro-batch check.

    Raises:
        ConfigError: not sequential, bad balance, fewer devices than partitions, ``chunks`` > batch size.
    """
    model = check_sequential(model)
    devices = [torch.device(d) for d in devices]
    if checkpoint not in CHECKPOINT_MODES:
        raise ConfigError(f"--checkpoint-mode {checkpoint!r}: choose one of {', '.join(CHECKPOINT_MODES)}")
    check_chunks(chunks, len(sample) if sample is not None else chunks)
    if balance is None:
        if sample is None:
            raise ConfigError("give a balance (layers per partition) or a sample batch to measure one on")
        balance = compute_balance(balance_by, len(devices), model, sample, chunks, devices[0], profile_seconds)
    balance = check_balance(balance, len(model), devices)
    # CPU: its tasks run on the calling thread, not on a thread started per mini-batch (only in this pipeline)
    return InlineGPipe(model, balance, devices=devices[:len(balance)], chunks=chunks, checkpoint=checkpoint)


class LazyGPipe(nn.Module):
    """An ``nn.Sequential`` that becomes a ``GPipe`` on its first call, so balancing can measure that batch.

    The layers are shared, not copied: an optimizer built on ``sequential.parameters()`` before the first
    call trains the pipelined model, and ``sequential.state_dict()`` is the plain model's checkpoint.
    """

    def __init__(self, sequential: nn.Sequential, build: Callable[[nn.Sequential, torch.Tensor], GPipe]):
        super().__init__()
        self.sequential = sequential
        self._build = build
        self.pipe: GPipe | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, ...)`` on the first device -> ``(B, num_classes)`` on the last."""
        if self.pipe is None:
            self.pipe = self._build(self.sequential, x)
        self.pipe.train(self.training)  # GPipe checkpoints only in training mode
        return self.pipe(x)


class GPipeStrategy(Strategy):
    """One process drives ``P`` partitions (one per GPU, or ``P × cpu``) with ``torchgpipe.GPipe``."""

    name = "gpipe"
    sequential_model = True
    supports_amp = False
    amp_note = "on GPUs its stages run in worker threads, and autocast is per thread"

    def __init__(self, env: DistEnv, options: dict | None = None):
        super().__init__(env, options)
        if env.world_size > 1:
            raise ConfigError("--strategy gpipe runs in one process that drives all devices; launch it without "
                              "torchrun (use --strategy pipeline for one stage per rank)")
        self.chunks = num_microbatches(self.options)
        self.checkpoint = self.options.get("checkpoint_mode") or "except_last"
        self.balance_by = self.options.get("balance_by") or "time"
        self.options.update(checkpoint_mode=self.checkpoint, balance_by=self.balance_by)
        self.balance = self.options.get("balance")
        partitions = self.options.get("partitions") or (len(self.balance) if self.balance else None)
        self._devices = gpipe_devices(partitions, env.device)
        check_chunks(self.chunks, self.chunks)

    def check_batch(self, batch_size: int) -> None:
        check_chunks(self.chunks, batch_size)

    @property
    def input_device(self) -> torch.device:
        return self._devices[0]

    @property
    def target_device(self) -> torch.device:
        return self._devices[-1]

    def prepare(self, model: nn.Module) -> nn.Module:
        model = check_sequential(model)
        if self.balance:
            check_balance(self.balance, len(model), self._devices)
        return LazyGPipe(model, self._build)

    def _build(self, model: nn.Sequential, sample: torch.Tensor) -> GPipe:
        pipe = make_gpipe(model, self._devices, self.chunks, self.checkpoint, self.balance, self.balance_by, sample)
        how = "given" if self.balance else f"by {self.balance_by}"
        print0(f"gpipe | balance {pipe.balance} ({how}) on {', '.join(map(str, pipe.devices))} | "
               f"{self.chunks} micro-batches | checkpoint {self.checkpoint}")
        self.balance = pipe.balance
        return pipe

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if model.pipe is None:
            check_chunks(self.chunks, len(x))  # later batches may be smaller: GPipe then uses fewer chunks
        return super().forward_backward(model, x, y, criterion)

    def placement(self, model: nn.Module) -> dict:
        return {"balance": list(self.balance)} if self.balance else {}

    def place(self, model: nn.Module, state: dict) -> None:
        """Partition now, by ``--balance`` or the checkpoint's, rather than on the first batch after the load."""
        if model.pipe is not None:
            return
        balance = self.balance or state.get("balance")
        if not balance:
            raise CheckpointError("it does not say how the layers were partitioned (no balance); resume with "
                                  "--balance as the first run printed it, or start without --resume")
        self.balance = [int(b) for b in balance]
        model.pipe = self._build(model.sequential, None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.sequential

    def devices(self) -> list[torch.device]:
        return list(self._devices)


def price_one_process_pipeline(plan, prof, topo) -> Estimate:
    """``gpipe`` (torchgpipe) and ``model-parallel``: one process drives ``k`` partitions, ``m`` micro-batches.

    On separate devices (GPUs) the partitions overlap as in :func:`pipeline_terms` (copies between devices
    priced as messages). On one CPU they share the cores, so nothing overlaps: ``compute = s·m·T_all(B/m)``
    and there is no bubble to speak of. GPipe's checkpointing (``except_last``) runs the forward again for
    all but the last micro-batch: ``recompute = s·(m − 1)·Σ_k fwd_k(B/m)``. GPipe also orders its
    micro-batches by joining each one's input with the previous one's output, so the first layer computes a
    gradient for the input of every micro-batch but the first: ``input gradient = s·(m − 1)·bwd_0(B/m)``
    (on separate devices part of stage 0's time). The input gradient of a convolution or a linear layer is the
    transposed operation on the output gradient, the same multiply-adds as its weight gradient, which is all
    the first layer's timed backward ``bwd_0`` computes (a training step asks no gradient of the data). Timed
    as a difference of two backward passes instead, it came out at 190 ms for LeNet's first convolution on 32
    samples on a busy 2-core machine, where the two passes, each timed at its fastest, differ by 1.3 ms and
    ``bwd_0`` is 1.4 ms.
    torchgpipe's own work per micro-batch and partition (its tasks, fork/join, the checkpoint functions) is not
    priced.
    Memory ``3P + M_all(B)`` (model-parallel, gpipe without checkpointing), or with checkpointing
    ``3P + M_all(B/m) + Σ_j m·(B/m)·A_{input of j}`` (each partition keeps only its inputs).
    """
    o = plan.option
    B, k = plan.batch_size, plan.devices
    m = o.get("num_microbatches") or (B // o["mp_split_size"] if o.get("mp_split_size") else 1)
    bm = B / m
    balance = o.get("balance") or balance_from_split_points(len(prof.layers), o.get("mp_split_points", ()))
    stages = stages_of(balance)
    s = compute_scale(topo, 1, prof)
    gpipe = plan.strategy == "gpipe" and m > 1  # torchgpipe, checkpointing except_last (what plans run)
    first = prof.layers[0]
    input_grad = s * (m - 1) * (first.bwd[0] + first.bwd[1] * bm) if gpipe else 0.0
    if topo.separate_devices:
        times = [s * prof.time(bm, st) + (input_grad / m if j == 0 else 0.0) for j, st in enumerate(stages)]
        comm = [2 * message_time(bm * prof.layers[st[-1]].out_bytes, topo) if j < k - 1 else 0.0
                for j, st in enumerate(stages)]
        time = pipeline_terms(times, comm, m, critical_path=True)
    else:
        time = {"compute": s * m * prof.time(bm)}
        if input_grad:
            time["input gradient"] = input_grad
    if gpipe:
        time["recompute"] = s * (m - 1) * sum(layer.fwd[0] + layer.fwd[1] * bm for layer in prof.layers)
        inputs = sum(prof.layers[st[0] - 1].out_bytes if st[0] else prof.input_bytes for st in stages)
        acts = prof.saved_bytes(bm) + B * inputs
    else:
        acts = prof.saved_bytes(B)
    time.update(common_terms(prof, topo, prof.param_bytes, B))
    return Estimate(plan, time, memory_terms(prof, topo, prof.param_bytes, acts))

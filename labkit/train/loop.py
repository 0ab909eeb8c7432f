"""THE training loop. Every strategy (single device, DDP, model/tensor parallel, hybrid, GPipe, pipeline
schedules) and every optimizer (SGD, Adam, SGD + K-FAC) runs through :func:`fit`.

    labkit train --model lenet --dataset mnist-sample --epochs 2                      # 1 CPU/GPU
    torchrun --nproc_per_node 4 -m labkit train --strategy ddp --model resnet32 \\
        --dataset cifar10 --optimizer kfac --base-lr 0.1 --batch-size 128 --epochs 100 \\
        --kfac-update-freq 10 --lr-decay 35 75 90                                      # 1 node, 4 GPUs

``labkit train``'s configuration and the run around this loop (data, model, checkpoints, results) are in
:mod:`labkit.train.run`.

Per step (:func:`train_step`): ``strategy.forward_backward`` -> ``strategy.sync_gradients`` ->
``preconditioner.step`` -> ``optimizer.step`` -> ``scheduler.step``, and the running metric sums. Each epoch
reseeds from (seed, epoch), so a run resumed from its checkpoint continues bit-identically.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from labkit.data import loader as loaders
from labkit.data.loader import TensorLoader
from labkit.dist.group import print0
from labkit.errors import LabkitError
from labkit.results import RunWriter
from labkit.strategies.base import Strategy
from labkit.train.meters import ThroughputMeter, interactive
from labkit.train.precision import autocast, to_channels_last
from labkit.train.preempt import Preempted, StopCheck, StopSignals
from labkit.train.rng import cuda_rng_states, restore_cuda_rng
from labkit.train.tasks import Task

_CLASSIFICATION = Task()


class TrainingDiverged(LabkitError):
    """The loss became NaN or infinite."""


def lr_factor(step: int, steps_per_epoch: int, decay_epochs: list[int], decay_factor: float,
              warmup_epochs: float, warmup_start: float) -> float:
    """Learning-rate multiplier at optimizer step ``step``.

    Step decay: × ``decay_factor`` at each epoch in ``decay_epochs`` (``--lr-decay 35 75 90``).
    Warm-up (Goyal et al. 2017): linear from ``warmup_start`` to 1 over the first ``warmup_epochs``.
    """
    epoch = step / steps_per_epoch
    factor = decay_factor ** sum(epoch >= e for e in decay_epochs)
    if epoch < warmup_epochs:
        factor *= warmup_start + (1 - warmup_start) * epoch / warmup_epochs
    return factor


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, strategy: Strategy, criterion: nn.Module, amp: str | None = None,
             channels_last: bool = False, task: Task | None = None) -> tuple[float, float]:
    """Mean loss and the task's metric (accuracy, perplexity) over ``loader``, summed over the ranks that own
    outputs. A sampler with a ``real`` attribute (:class:`labkit.parallel.mesh.PaddedShardSampler`) is padded
    to the same length on every rank; only its first ``real`` samples are counted."""
    task = task or Task()
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, metric sum, count
    # a padded shard (every rank runs the same batches, e.g. a mesh's): only its first `real` samples count
    real, seen = getattr(getattr(loader, "sampler", None), "real", None), 0
    for x, y in loader:
        x = x.to(strategy.input_device)
        with autocast(amp, strategy.input_device):
            out = strategy.forward(model, to_channels_last(x) if channels_last else x)
        keep = len(y) if real is None else max(0, min(len(y), real - seen))
        seen += len(y)
        if out is not None and keep and strategy.metric_owner():
            out, y = out[:keep], y[:keep].to(out.device)
            totals += task.sums(criterion(out, y), out, y).cpu()
    values = task.metrics(*strategy.all_reduce_sum(totals).tolist())
    return values["loss"], values[task.metric]


def fit(model: nn.Module, train_loader: DataLoader, test_loader: DataLoader | None, optimizer: torch.optim.Optimizer,
        *, epochs: int, strategy: Strategy | None = None, preconditioner=None, scheduler=None,
        criterion: nn.Module | None = None, writer: RunWriter | None = None, start_epoch: int = 0, seed: int = 0,
        max_steps: int | None = None, total_steps: int | None = None, log_every: int = 20, on_epoch_end: Callable[[int], None] | None = None,
        profiler=None, printer: Callable[[str], None] = print0, amp: str | None = None,
        channels_last: bool = False, position: dict | None = None, stop: StopSignals | None = None,
        on_stop: Callable[[int, dict], None] | None = None, step_delay_s: float = 0.0,
        task: Task | None = None, utilisation=None) -> list[dict]:
    """Train ``model`` for ``epochs`` epochs and evaluate after each; return one record per epoch.

    Args:
        model: already placed by ``strategy.prepare`` (a plain module on one device works as is).
        strategy: where data and model live and how gradients meet (default: the single-device one).
        preconditioner: e.g. K-FAC; ``step()`` rewrites gradients before ``optimizer.step()``.
        scheduler: stepped after every optimizer step.
        max_steps: stop each epoch after this many steps (quick runs).
        total_steps: stop the run after this many steps in all (``labkit train --steps``), cutting its last epoch
            short; ``epochs`` must be enough to hold them.
        amp: ``"bf16"``: forward passes under autocast (:mod:`labkit.train.precision`).
        channels_last: feed image batches in NHWC order (convert the model before ``strategy.prepare``).
        on_epoch_end: called with the finished epoch index (checkpointing).
        profiler: a ``torch.profiler.profile`` to ``step()`` every iteration.
        position: where in epoch ``start_epoch`` a mid-epoch checkpoint stopped (:func:`epoch_position`).
        stop: checked within an epoch every few tenths of a second without blocking (:class:`StopCheck`) and
            after every epoch; when any rank got a stop signal, every rank stops after the same step, calls
            ``on_stop(epoch, position)`` (checkpointing) and raises :class:`Preempted`.
        step_delay_s: sleep after every step: a pre-emption drill needs a run slow enough to interrupt.
        task: the loss, counts and metrics (:mod:`labkit.train.tasks`; default: classification). ``criterion``, if
            given, replaces the task's loss (e.g. a vocabulary-parallel one taking the same arguments).
        utilisation: a :class:`labkit.train.peak.FlopUtilisation`: each epoch's rate also as MFU and HFU, at the
            end of the epoch's line (``... | lr 0.05 | MFU 3.41%, HFU 3.41%``) and in its record (arithmetic on the
            epoch's rate once its window closes: nothing per step).

    Returns:
        ``[{"kind": "epoch", "epoch", "train_loss", "train_acc", "test_loss", "test_acc",
        "samples_per_sec", "timed_steps", "window_s", "lr", "time_s"}, ...]``: ``samples_per_sec`` is timed
        over ``window_s`` seconds of ``timed_steps`` steps after the warm-up, between barriers of all ranks.
        Language modelling has ``train_ppl``/``test_ppl`` in place of the accuracies, and ``tokens_per_sec``; with
        ``utilisation``, ``mfu``, ``hfu`` and ``model_flops_per_s``.
    """
    if strategy is None:
        strategy = single_strategy(model)
    task = task or Task()
    criterion = criterion or task.criterion()
    metric = task.metric
    history = []
    rank = dist.get_rank() if dist.is_initialized() else 0
    if max_steps is not None and max_steps > len(train_loader):
        printer(f"note: --max-steps {max_steps} is more than the {len(train_loader)} steps of an epoch; "
                f"each epoch runs its {len(train_loader)} steps")
    for epoch in range(start_epoch, epochs):
        # dropout/augmentation: reproducible per epoch; one stream per rank, shared by a tp group's ranks
        torch.manual_seed(seed * 100_003 + epoch * 1_009 + strategy.seed_rank(rank))
        if isinstance(train_loader, (DataLoader, TensorLoader)):
            loaders.set_loader_epoch(train_loader, epoch, seed)  # same shuffle on every rank, fresh or resumed
        strategy.set_epoch(epoch)
        model.train()
        steps = len(train_loader) if max_steps is None else min(max_steps, len(train_loader))
        if total_steps is not None:  # epochs before this one ran `steps` each
            steps = max(0, min(steps, total_steps - epoch * steps))
        bar = _progress(steps, f"epoch {epoch + 1}/{epochs}", rank)  # None: the throughput lines are the progress
        # (loss sum, metric sum, count) stay on the device: no host sync per step; checked every log_every steps
        totals = torch.zeros(3, dtype=torch.float64, device=strategy.target_device)
        started = time.perf_counter()
        batches, first = iter(train_loader), 0
        if position is not None and epoch == start_epoch:
            first = _resume_position(batches, position, totals, rank)
            if bar is not None:
                bar.update(first)
        meter = ThroughputMeter(epoch + 1, epochs, steps, every=log_every, world_factor=strategy.data_parallel_size,
                                printer=printer, device=strategy.input_device, first=first, barrier=_barrier(strategy),
                                tokens=task.name == "lm",
                                estimate_printer=None if bar is None else (
                                    lambda line: bar.set_postfix_str(line.rsplit(" | ", 1)[-1])))
        check = StopCheck(stop, strategy, steps) if stop is not None else None
        for step, (x, y) in enumerate(batches, start=first):
            if step >= steps:
                break
            owner = train_step(model, x, y, optimizer, strategy, criterion, totals, preconditioner=preconditioner,
                               scheduler=scheduler, profiler=profiler, amp=amp, channels_last=channels_last, task=task)
            if owner and ((step + 1) % log_every == 0 or step + 1 == steps):
                _check_finite(totals[0], epoch, step)
            meter.update(len(x), task.tokens_per_sample(x))
            if bar is not None:
                bar.update()
            if step_delay_s:
                time.sleep(step_delay_s)
            if check is not None and check.after_step(step):
                _stop(stop, epoch, epoch_position(step + 1, totals, strategy), on_stop)
        if check is not None:
            check.close()
        if bar is not None:
            bar.close()  # before the epoch's line, so the bar does not share a line with it
        rate = meter.finish()
        strategy.epoch_end()
        train = task.metrics(*strategy.all_reduce_sum(totals.cpu()).tolist())
        test_loss, test_metric = (evaluate(model, test_loader, strategy, criterion, amp, channels_last, task)
                                  if test_loader is not None else (math.nan,) * 2)
        record = {"kind": "epoch", "epoch": epoch + 1, "train_loss": train["loss"], f"train_{metric}": train[metric],
                  "test_loss": test_loss, f"test_{metric}": test_metric, "samples_per_sec": rate,
                  **({"tokens_per_sec": meter.tokens_per_sec} if meter.tokens else {}),
                  **(utilisation.of(rate) if utilisation is not None else {}),
                  "timed_steps": meter.timed_steps, "window_s": meter.window_s,
                  "lr": optimizer.param_groups[0]["lr"], "time_s": time.perf_counter() - started}
        printer(f"epoch {epoch + 1}/{epochs} | train loss {train['loss']:.4f} {metric} {train[metric]:.4f}"
                f" | test loss {test_loss:.4f} {metric} {test_metric:.4f} | lr {record['lr']:.4g}"
                + (f" | {utilisation.text(rate)}" if utilisation is not None and rate else ""))
        history.append(record)
        if writer is not None:
            writer.log(record)
        if on_epoch_end is not None:
            on_epoch_end(epoch)
        if stop is not None and epoch + 1 < epochs and stop.requested(strategy):
            raise Preempted(stop.received, epoch + 1, 0)
    return history


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer,
               strategy: Strategy, criterion: nn.Module, totals: torch.Tensor, *, preconditioner=None, scheduler=None,
               profiler=None, amp: str | None = None, channels_last: bool = False, task: Task | None = None) -> bool:
    """One optimizer step of :func:`fit` on the batch ``(x, y)``, its bookkeeping included.

    ``strategy.forward_backward`` -> ``strategy.sync_gradients`` -> ``preconditioner.step`` ->
    ``optimizer.step`` -> ``scheduler.step`` (-> ``profiler.step``), the three only when
    ``strategy.step_committed()`` (a discarded step changes nothing and counts no metric); on a rank that owns the outputs, the
    batch's sums from ``task`` (default classification: loss sum, correct predictions, sample count; language
    modelling counts tokens) are added to ``totals`` (on the device: no host sync, no host-to-device copy).
    The strategy advisor times this very function (:mod:`labkit.advisor.measure`).

    Returns:
        whether this rank added to ``totals``.
    """
    x = x.to(strategy.input_device, non_blocking=True)  # (B, C, H, W) images or (B, T) tokens
    y = y.to(strategy.target_device, non_blocking=True)  # (B,) labels or (B, T) next tokens
    optimizer.zero_grad(set_to_none=True)
    with autocast(amp, strategy.input_device):
        loss, out = strategy.forward_backward(model, to_channels_last(x) if channels_last else x, y, criterion)
    strategy.sync_gradients(model)
    committed = strategy.step_committed()  # False: a fault-tolerant quorum discarded this step on every member
    if committed and preconditioner is not None:
        preconditioner.step()
    if committed:
        optimizer.step()
    if committed and scheduler is not None:
        scheduler.step()
    if profiler is not None:
        profiler.step()
    if loss is None or not committed or not strategy.metric_owner():
        return False
    y = y.to(out.device)
    totals += (task or _CLASSIFICATION).sums(loss, out, y).to(totals.device)
    return True


# ----- where in the epoch a run is: what a mid-epoch checkpoint adds -----------------------------------


def epoch_position(step: int, totals: torch.Tensor, strategy: Strategy) -> dict:
    """The state that puts a run back at ``step`` of its epoch: the step, and every rank's RNG states and
    running metric sums (``[rank]`` lists, gathered from all ranks, so rank 0's checkpoint holds them all).

    The shuffle needs no state: each epoch reseeds it from (seed, epoch), and resuming skips ``step`` batches.
    """
    mine = {"rng": torch.get_rng_state(), "totals": totals.cpu(), "cuda_rng": cuda_rng_states(strategy.devices())}
    ranks = [mine]
    if strategy.env.distributed:
        ranks = [None] * strategy.env.world_size
        dist.all_gather_object(ranks, mine)
    return {"step": step, **{key: [r[key] for r in ranks] for key in mine}}


def _resume_position(batches, position: dict, totals: torch.Tensor, rank: int) -> int:
    """Skip the batches done before the checkpoint, then restore this rank's RNG states and metric sums;
    return the step to continue from. The RNG comes back after the skip: drawing those batches used it."""
    for _ in range(position["step"]):
        next(batches)
    torch.set_rng_state(position["rng"][rank])
    left_out = restore_cuda_rng(position["cuda_rng"][rank])
    if left_out:
        print0(f"the checkpoint's random state of GPU(s) {left_out} is not restored: this node does not see them")
    totals.copy_(position["totals"][rank])
    return position["step"]


def _stop(stop: StopSignals, epoch: int, position: dict, on_stop: Callable[[int, dict], None] | None) -> None:
    if on_stop is not None:
        on_stop(epoch, position)
    raise Preempted(stop.received, epoch, position["step"])


def _barrier(strategy: Strategy) -> Callable[[], None] | None:
    """The barrier that bounds the throughput window on every rank (None: one process)."""
    if not strategy.env.distributed:
        return None

    def barrier() -> None:
        if strategy.step_boundary():  # ranks that run different numbers of steps time their own window
            dist.barrier()
    return barrier


def _check_finite(loss_sum: torch.Tensor, epoch: int, step: int) -> None:
    if not torch.isfinite(loss_sum):
        raise TrainingDiverged(f"loss became {loss_sum.item()} by epoch {epoch + 1}, step {step}; "
                               "lower --base-lr, add --warmup-epochs, or check the data")


def single_strategy(model: nn.Module) -> Strategy:
    """The single-device strategy for a plain ``model``, on the device its parameters are on."""
    from labkit.dist.group import DistEnv

    param = next(model.parameters(), None)
    return Strategy(DistEnv(device=param.device if param is not None else torch.device("cpu")))


def _progress(steps: int, desc: str, rank: int):
    """A tqdm bar over the epoch's steps in a terminal on rank 0, else None."""
    if rank != 0 or not interactive():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc=desc, leave=False)

"""THE training loop. Every strategy (single device, DDP, model/tensor parallel, hybrid, GPipe, pipeline
schedules) and every optimizer (SGD, Adam, SGD + K-FAC) runs through :func:`fit`.

    labkit train --model lenet --dataset mnist-sample --epochs 2                      # 1 CPU/GPU
    torchrun --nproc_per_node 4 -m labkit train --strategy ddp --model resnet32 \\
        --dataset cifar10 --optimizer kfac --base-lr 0.1 --batch-size 128 --epochs 100 \\
        --kfac-update-freq 10 --lr-decay 35 75 90                                      # 1 node, 4 GPUs

Per step (:func:`train_step`): ``strategy.forward_backward`` -> ``strategy.sync_gradients`` ->
``preconditioner.step`` -> ``optimizer.step`` -> ``scheduler.step``, and the running metric sums. Each epoch
reseeds from (seed, epoch), so a run resumed from its checkpoint continues bit-identically.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from labkit import backends
from labkit import data as kdata
from labkit import dist as kdist
from labkit import models as kmodels
from labkit.checkpoint import checkpoint_on_every_rank, checkpoint_path, load_training_state, save_training_state
from labkit.dist import distributed, print0
from labkit.errors import ConfigError, LabkitError
from labkit.meters import ThroughputMeter, interactive, memory_lines, peak_memory_gb
from labkit.monitor import UtilisationMonitor, nvml_indices
from labkit.monitor import gather as gather_utilisation
from labkit.optim import OptimizerSpec
from labkit.precision import autocast, check_amp, to_channels_last
from labkit.preempt import Preempted, StopCheck, StopSignals, clear_marker, signal_of_any_rank, write_marker
from labkit.ranges import check
from labkit.results import RunWriter, make_dirs
from labkit.rng import cuda_rng_states, restore_cuda_rng
from labkit.strategies import Strategy, get_strategy
from labkit.tensor_data import LOADERS, TensorLoader, load_split
from labkit.train_cli import NUMBERS

#: strategies that spread over the ranks of a process group: run in one process, they get a note
SPREAD_OVER_RANKS = ("ddp", "zero", "hybrid", "tensor-parallel")


class TrainingDiverged(LabkitError):
    """The loss became NaN or infinite."""


@dataclass
class TrainConfig:
    """Everything ``labkit train`` takes. ``batch_size`` is per data-parallel rank; the global batch is
    ``batch_size × strategy.data_parallel_size``."""

    model: str = "lenet"
    dataset: str = "mnist-sample"
    epochs: int = 1
    batch_size: int = 64
    test_batch_size: int = 512
    optimizer: str = "sgd"
    base_lr: float | None = None  # None: the model's default (labkit.models.default_lr)
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_decay: list[int] = field(default_factory=list)
    lr_decay_factor: float = 0.1
    warmup_epochs: float = 0.0
    scale_lr: bool = False
    strategy: str = "single"
    device: str = "auto"
    backend: str | None = None
    seed: int = 0
    out: str | None = None
    name: str | None = None
    resume: bool = False
    checkpoint: bool = True
    profile: bool = False
    max_steps: int | None = None
    train_size: int | None = None
    test_size: int | None = None
    augment: bool = False
    data_root: str | None = None
    download: bool = False
    num_workers: int = 0
    loader: str = "tensor"
    amp: str | None = None
    channels_last: bool = False
    log_every: int = 20
    timeout_s: float = 1800.0
    step_delay_s: float = 0.0
    strategy_options: dict = field(default_factory=dict)
    optim_options: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad value."""
        for key, (kind, interval) in NUMBERS.items():  # what the flags check as they are read
            check(f"--{key.replace('_', '-')}", getattr(self, key), kind, interval)
        if list(self.lr_decay) != sorted(set(self.lr_decay)):
            ordered = " ".join(map(str, sorted(set(self.lr_decay))))
            raise ConfigError(f"--lr-decay epochs must be increasing, e.g. --lr-decay {ordered}; "
                              f"got {' '.join(map(str, self.lr_decay))}")
        if self.loader not in LOADERS:
            raise ConfigError(f"--loader {self.loader!r} is not one of: {', '.join(LOADERS)}")
        if self.loader == "tensor" and self.num_workers:
            raise ConfigError("--num-workers applies to --loader torch; the tensor loader has no workers")
        check_amp(self.amp, self.strategy)

    @property
    def out_dir(self) -> Path:
        return Path(self.out or Path("runs") / self.run_name)

    @property
    def run_name(self) -> str:
        return self.name or f"{self.model}-{self.dataset}-{self.strategy}-{self.optimizer}"


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
             channels_last: bool = False) -> tuple[float, float]:
    """Mean loss and accuracy over ``loader``, summed over the ranks that own outputs."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for x, y in loader:
        x = x.to(strategy.input_device)
        with autocast(amp, strategy.input_device):
            out = strategy.forward(model, to_channels_last(x) if channels_last else x)
        if out is not None and strategy.metric_owner():
            y = y.to(out.device)
            totals += torch.tensor([criterion(out, y).item() * len(y), (out.argmax(1) == y).sum().item(), len(y)],
                                   dtype=torch.float64)
    loss_sum, correct, count = strategy.all_reduce_sum(totals).tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


def fit(model: nn.Module, train_loader: DataLoader, test_loader: DataLoader | None, optimizer: torch.optim.Optimizer,
        *, epochs: int, strategy: Strategy | None = None, preconditioner=None, scheduler=None,
        criterion: nn.Module | None = None, writer: RunWriter | None = None, start_epoch: int = 0, seed: int = 0,
        max_steps: int | None = None, log_every: int = 20, on_epoch_end: Callable[[int], None] | None = None,
        profiler=None, printer: Callable[[str], None] = print0, amp: str | None = None,
        channels_last: bool = False, position: dict | None = None, stop: StopSignals | None = None,
        on_stop: Callable[[int, dict], None] | None = None, step_delay_s: float = 0.0) -> list[dict]:
    """Train ``model`` for ``epochs`` epochs and evaluate after each; return one record per epoch.

    Args:
        model: already placed by ``strategy.prepare`` (a plain module on one device works as is).
        strategy: where data and model live and how gradients meet (default: the single-device one).
        preconditioner: e.g. K-FAC; ``step()`` rewrites gradients before ``optimizer.step()``.
        scheduler: stepped after every optimizer step.
        max_steps: stop each epoch after this many steps (quick runs).
        amp: ``"bf16"``: forward passes under autocast (:mod:`labkit.precision`).
        channels_last: feed image batches in NHWC order (convert the model before ``strategy.prepare``).
        on_epoch_end: called with the finished epoch index (checkpointing).
        profiler: a ``torch.profiler.profile`` to ``step()`` every iteration.
        position: where in epoch ``start_epoch`` a mid-epoch checkpoint stopped (:func:`epoch_position`).
        stop: checked within an epoch every few tenths of a second without blocking (:class:`StopCheck`) and
            after every epoch; when any rank got a stop signal, every rank stops after the same step, calls
            ``on_stop(epoch, position)`` (checkpointing) and raises :class:`Preempted`.
        step_delay_s: sleep after every step: a pre-emption drill needs a run slow enough to interrupt.

    Returns:
        ``[{"kind": "epoch", "epoch", "train_loss", "train_acc", "test_loss", "test_acc",
        "samples_per_sec", "timed_steps", "window_s", "lr", "time_s"}, ...]``: ``samples_per_sec`` is timed
        over ``window_s`` seconds of ``timed_steps`` steps after the warm-up, between barriers of all ranks.
    """
    if strategy is None:
        strategy = single_strategy(model)
    criterion = criterion or nn.CrossEntropyLoss()
    history = []
    rank = dist.get_rank() if dist.is_initialized() else 0
    if max_steps is not None and max_steps > len(train_loader):
        printer(f"note: --max-steps {max_steps} is more than the {len(train_loader)} steps of an epoch; "
                f"each epoch runs its {len(train_loader)} steps")
    for epoch in range(start_epoch, epochs):
        torch.manual_seed(seed * 100_003 + epoch * 1_009 + rank)  # dropout/augmentation: reproducible per epoch
        if isinstance(train_loader, (DataLoader, TensorLoader)):
            kdata.set_loader_epoch(train_loader, epoch, seed)  # same shuffle on every rank, fresh or resumed
        strategy.set_epoch(epoch)
        model.train()
        steps = len(train_loader) if max_steps is None else min(max_steps, len(train_loader))
        bar = _progress(steps, f"epoch {epoch + 1}/{epochs}", rank)  # None: the throughput lines are the progress
        # (loss sum, correct, count) stay on the device: no host sync per step; checked every log_every steps
        totals = torch.zeros(3, dtype=torch.float64, device=strategy.target_device)
        started = time.perf_counter()
        batches, first = iter(train_loader), 0
        if position is not None and epoch == start_epoch:
            first = _resume_position(batches, position, totals, rank)
            if bar is not None:
                bar.update(first)
        meter = ThroughputMeter(epoch + 1, epochs, steps, every=log_every, world_factor=strategy.data_parallel_size,
                                printer=printer, device=strategy.input_device, first=first, barrier=_barrier(strategy),
                                estimate_printer=None if bar is None else (
                                    lambda line: bar.set_postfix_str(line.rsplit(" | ", 1)[-1])))
        check = StopCheck(stop, strategy, steps) if stop is not None else None
        for step, (x, y) in enumerate(batches, start=first):
            if step >= steps:
                break
            owner = train_step(model, x, y, optimizer, strategy, criterion, totals, preconditioner=preconditioner,
                               scheduler=scheduler, profiler=profiler, amp=amp, channels_last=channels_last)
            if owner and ((step + 1) % log_every == 0 or step + 1 == steps):
                _check_finite(totals[0], epoch, step)
            meter.update(len(x))
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
        loss_sum, correct, count = strategy.all_reduce_sum(totals.cpu()).tolist()
        test_loss, test_acc = (evaluate(model, test_loader, strategy, criterion, amp, channels_last) if test_loader is not None
                               else (math.nan,) * 2)
        record = {"kind": "epoch", "epoch": epoch + 1, "train_loss": loss_sum / max(count, 1),
                  "train_acc": correct / max(count, 1), "test_loss": test_loss, "test_acc": test_acc,
                  "samples_per_sec": rate, "timed_steps": meter.timed_steps, "window_s": meter.window_s,
                  "lr": optimizer.param_groups[0]["lr"],
                  "time_s": time.perf_counter() - started}
        printer(f"epoch {epoch + 1}/{epochs} | train loss {record['train_loss']:.4f} acc {record['train_acc']:.4f}"
                f" | test loss {test_loss:.4f} acc {test_acc:.4f} | lr {record['lr']:.4g}")
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
               profiler=None, amp: str | None = None, channels_last: bool = False) -> bool:
    """One optimizer step of :func:`fit` on the batch ``(x, y)``, its bookkeeping included.

    ``strategy.forward_backward`` -> ``strategy.sync_gradients`` -> ``preconditioner.step`` ->
    ``optimizer.step`` -> ``scheduler.step`` (-> ``profiler.step``); on a rank that owns the outputs, the
    batch's loss sum, correct predictions and sample count are added to ``totals`` (on the device: no host sync,
    no host-to-device copy).
    The strategy advisor times this very function (:mod:`labkit.advisor.profile`).

    Returns:
        whether this rank added to ``totals``.
    """
    x = x.to(strategy.input_device, non_blocking=True)  # (B, C, H, W)
    y = y.to(strategy.target_device, non_blocking=True)  # (B,)
    optimizer.zero_grad(set_to_none=True)
    with autocast(amp, strategy.input_device):
        loss, out = strategy.forward_backward(model, to_channels_last(x) if channels_last else x, y, criterion)
    strategy.sync_gradients(model)
    if preconditioner is not None:
        preconditioner.step()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if profiler is not None:
        profiler.step()
    if loss is None or not strategy.metric_owner():
        return False
    y = y.to(out.device)
    count = torch.full((), float(len(y)), dtype=torch.float64, device=out.device)  # a fill kernel, no copy
    totals += torch.stack([loss.double() * len(y), (out.argmax(1) == y).sum().double(), count]).to(totals.device)
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
    from labkit.dist import DistEnv

    param = next(model.parameters(), None)
    return Strategy(DistEnv(device=param.device if param is not None else torch.device("cpu")))


def _progress(steps: int, desc: str, rank: int):
    """A tqdm bar over the epoch's steps in a terminal on rank 0, else None."""
    if rank != 0 or not interactive():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc=desc, leave=False)


# ----- the `labkit train` path -----------------------------------------------------------------------------


def run(cfg: TrainConfig) -> dict:
    """Build everything from ``cfg``, train, write results; return the summary (same on every rank)."""
    cfg.validate()
    strategy_cls = get_strategy(cfg.strategy)
    make_dirs(cfg.out_dir)  # an unwritable --out fails now, not after the data is loaded
    if cfg.base_lr is None:
        cfg.base_lr = kmodels.default_lr(cfg.model)
    with distributed(cfg.device, cfg.backend, seed=cfg.seed, timeout_s=cfg.timeout_s,
                     strategy=backends.key(cfg.strategy, cfg.strategy_options)) as env:
        strategy = strategy_cls(env, cfg.strategy_options)
        cfg.strategy_options = {**cfg.strategy_options, **strategy.options}  # record defaults as they ran
        cfg.batch_size = strategy.per_rank_batch_size(cfg.batch_size)  # e.g. ddp's --global-batch-size
        info = kdata.dataset_info(cfg.dataset)
        split = dict(loader=cfg.loader, name=cfg.dataset, root=cfg.data_root, download=cfg.download,
                     device=strategy.input_device)
        train_set = load_split(**split, train=True, augment=cfg.augment, limit=cfg.train_size)
        test_set = load_split(**split, train=False, limit=cfg.test_size)
        dp = strategy.data_parallel_size
        if len(train_set) < dp * cfg.batch_size:
            raise ConfigError(f"the training set has {len(train_set)} samples, fewer than one global batch "
                              f"({dp} ranks × --batch-size {cfg.batch_size}); use fewer ranks or a smaller batch")
        model = kmodels.get_model(cfg.model, num_classes=info.num_classes, in_channels=info.in_channels,
                                  image_size=info.image_size, sequential=strategy.sequential_model)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)  # before DDP/partitioning take views of the weights
        model = strategy.prepare(model)
        lr = cfg.base_lr * (dp if cfg.scale_lr else 1)
        optimizer, preconditioner = strategy.build_optimizer(model, OptimizerSpec(
            cfg.optimizer, lr, cfg.momentum, cfg.weight_decay, cfg.optim_options, env))
        pin = strategy.input_device.type == "cuda"  # --loader torch: pinned batches make non_blocking copies async
        train_loader = kdata.make_loader(train_set, cfg.batch_size, shuffle=True,
                                         sampler=strategy.sampler(train_set, True, cfg.seed), seed=cfg.seed,
                                         drop_last=dp > 1, num_workers=cfg.num_workers, pin_memory=pin)
        test_loader = kdata.make_loader(test_set, cfg.test_batch_size, shuffle=False, pin_memory=pin,
                                        sampler=strategy.sampler(test_set, False, cfg.seed), num_workers=cfg.num_workers)
        steps = len(train_loader) if cfg.max_steps is None else min(cfg.max_steps, len(train_loader))
        warmup_start = 1 / dp if cfg.scale_lr and dp > 1 else 1 / max(1.0, cfg.warmup_epochs * steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
            s, steps, cfg.lr_decay, cfg.lr_decay_factor, cfg.warmup_epochs, warmup_start))
        out_dir = cfg.out_dir
        writer = RunWriter(out_dir, enabled=env.is_main, append=cfg.resume)
        ckpt = checkpoint_path(out_dir, strategy)
        start_epoch, position = 0, None
        if cfg.resume and checkpoint_on_every_rank(ckpt, strategy):
            state = load_training_state(ckpt, strategy, model, optimizer, scheduler, preconditioner, asdict(cfg))
            start_epoch, position = state["epoch"], state.get("position")
            within = f", step {position['step']}" if position else ""
            print0(f"resumed from {ckpt} at epoch {start_epoch}{within}")

        def save(epochs_done: int, position: dict | None = None) -> None:
            """The checkpoint after ``epochs_done`` epochs and, mid-epoch, ``position`` in the next one."""
            if cfg.checkpoint:
                save_training_state(ckpt, strategy, model, optimizer, scheduler, preconditioner,
                                    {"epoch": epochs_done, "position": position}, asdict(cfg))

        if not env.distributed and cfg.strategy in SPREAD_OVER_RANKS:  # legitimate, but rarely what was meant
            print0(f"note: one process, so --strategy {cfg.strategy} runs on 1 rank; for N ranks start it with "
                   f"torchrun --nproc_per_node N -m labkit train --strategy {cfg.strategy} ... (or srun)")
        print0(f"labkit train | {cfg.model} on {cfg.dataset} | strategy {cfg.strategy} | {env.world_size} rank(s) "
               f"on {env.device} | batch {cfg.batch_size}/rank, {cfg.batch_size * dp} global | lr {lr:g}")
        started = time.perf_counter()
        monitor = UtilisationMonitor(interval_s=1.0, gpus=nvml_indices(strategy.devices()))
        with _profiler(cfg.profile, out_dir, env.rank) as prof, monitor, _stop_signals(cfg.checkpoint) as stop:
            try:
                history = fit(model, train_loader, test_loader, optimizer, epochs=cfg.epochs, strategy=strategy,
                              preconditioner=preconditioner, scheduler=scheduler, writer=writer,
                              start_epoch=start_epoch, seed=cfg.seed, max_steps=cfg.max_steps,
                              log_every=cfg.log_every, on_epoch_end=lambda epoch: save(epoch + 1), profiler=prof,
                              amp=cfg.amp, channels_last=cfg.channels_last, position=position, stop=stop,
                              on_stop=save, step_delay_s=cfg.step_delay_s)
            except Preempted as stopped:
                name = signal_of_any_rank(stopped.signal_name, env)
                if env.is_main:
                    write_marker(out_dir, stopped.epoch, stopped.step, name)
                raise Preempted(name, stopped.epoch, stopped.step) from None
        if env.is_main:
            clear_marker(out_dir)
        lines = memory_lines(strategy.devices())
        if env.distributed:  # every rank measures its own process and devices: say whose line it is
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, lines)
            lines = [f"rank {r}: {line}" for r, rank_lines in enumerate(gathered) for line in rank_lines]
        for line in lines:
            print0(line)
        peak = torch.tensor([peak_memory_gb(strategy.devices())])
        if env.distributed:
            kdist.all_reduce(peak, op=dist.ReduceOp.MAX)
        last = history[-1] if history else {}
        metrics = {"samples_per_sec": last.get("samples_per_sec"), "peak_memory_gb": peak.item(),
                   "final_test_acc": last.get("test_acc"), "final_train_loss": last.get("train_loss"),
                   "best_test_acc": max((r["test_acc"] for r in history), default=None),
                   "epochs_run": len(history), "time_s": time.perf_counter() - started,
                   "throughput_window": {  # the window of samples_per_sec
                       "epoch": last["epoch"], "timed_steps": last["timed_steps"], "seconds": last["window_s"],
                       "barriers": env.distributed and strategy.step_boundary()} if last else None,
                   "global_batch_size": cfg.batch_size * dp, "memory_lines": lines,
                   "utilisation": gather_utilisation(monitor, env, writer)}
        summary = writer.finish(cfg.run_name, "train", asdict(cfg), metrics, env)
        strategy.close()
        print0(f"results written to {out_dir}/summary.json and {out_dir}/metrics.jsonl")
    return summary


def _stop_signals(enabled: bool):
    """Catch the stop signals only when a checkpoint can be written: without one, stopping early saves nothing."""
    return StopSignals() if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _profiler(enabled: bool, out_dir: Path, rank: int):
    """``--profile``: a torch.profiler trace of a few steps, viewable in TensorBoard or Perfetto."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    trace_dir = Path(out_dir) / "profile"
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}"),
                 record_shapes=True) as prof:
        yield prof
    print0(f"profiler trace written to {trace_dir} (open in TensorBoard or https://ui.perfetto.dev)")

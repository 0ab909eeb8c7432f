"""``labkit train`` as a function: :class:`TrainConfig` and :func:`run`, which build the process group, data,
model, strategy, optimizer and schedule from a configuration, call :func:`labkit.train.loop.fit`, and write the
checkpoints and results.

    from labkit.train.config import TrainConfig

    from labkit.train.run import run
    summary = run(TrainConfig(model="lenet", dataset="mnist-sample", epochs=2))
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.data import datasets as kdata
from labkit.data import loader as loaders
from labkit.data.tensor import load_split
from labkit.data.text import DEFAULT_SEQ_LEN
from labkit.dist import group as kdist
from labkit.dist.group import distributed, print0
from labkit.errors import ConfigError
from labkit.models import cnn as kmodels
from labkit.models.names import LANGUAGE_MODELS
from labkit.optim import OptimizerSpec
from labkit.results import RunWriter, make_dirs, run_dir_lock
from labkit.strategies import backends, get_strategy, strategy_literal
from labkit.train.checkpoint import checkpoint_on_every_rank, checkpoint_path, load_training_state, save_training_state
from labkit.train.config import TrainConfig
from labkit.train.flops import StepFlops, counted_once
from labkit.train.loop import fit, lr_factor
from labkit.train.meters import memory_lines, peak_memory_gb
from labkit.train.monitor import UtilisationMonitor, nvml_indices
from labkit.train.monitor import gather as gather_utilisation
from labkit.train.peak import FlopUtilisation, Peak, device_peak, flops_text
from labkit.train.preempt import (
    Preempted,
    StopSignals,
    attempt_started,
    attempt_stopped,
    attempts,
    clear_marker,
    now_utc,
    signal_of_any_rank,
    where,
    write_marker,
)
from labkit.train.tasks import get_task


def spread_over_ranks(name: str) -> bool:
    """Does strategy ``name`` spread over the ranks of a process group (run in one process it gets a note)? Its
    module's ``ADVISOR`` literal says so, ``"plans": "spread"``: a new strategy declares it there, nothing here."""
    return (strategy_literal(name, "ADVISOR", None) or {}).get("plans") == "spread"


def run(cfg: TrainConfig, env: kdist.DistEnv | None = None) -> dict:
    """Build everything from ``cfg``, train, write results; return the summary (same on every rank).

    ``env``: a process group already set up (a rank of :func:`labkit.dist.testing.run_ranks`) to train on, seeded
    with ``cfg.seed`` as a fresh one would be; None (``labkit train``) sets one up and tears it down.
    """
    cfg.validate()
    strategy_cls = get_strategy(cfg.strategy)
    make_dirs(cfg.out_dir)  # an unwritable --out fails now, not after the data is loaded
    if cfg.base_lr is None:
        cfg.base_lr = kmodels.default_lr(cfg.model, cfg.optimizer)
    table_key = backends.key(cfg.strategy, cfg.strategy_options)
    with (distributed(backends.auto_device(table_key, cfg.backend, cfg.device), cfg.backend, seed=cfg.seed,
                      timeout_s=cfg.timeout_s, refusal=backends.refusal_of(table_key))
          if env is None else _given(env, cfg.seed)) as env, contextlib.ExitStack() as held:
        _lock_out(cfg.out_dir, env, held)
        if cfg.deterministic:
            kdist.deterministic_kernels()
        strategy = strategy_cls(env, cfg.strategy_options)
        # e.g. a mesh dimension the model cannot take: one line, before any work
        strategy.check_model(cfg.model, cfg.seq_len or DEFAULT_SEQ_LEN, cfg.dropout)
        cfg.strategy_options = {**cfg.strategy_options, **strategy.options}  # record defaults as they ran
        cfg.batch_size = strategy.per_rank_batch_size(cfg.batch_size)  # e.g. ddp's --global-batch-size
        strategy.check_batch(cfg.batch_size)  # e.g. more micro-batches than samples: one line, before the banner
        info = kdata.dataset_info(cfg.dataset, cfg.data_root)
        task = get_task(info.task)
        split = dict(loader=cfg.loader, name=cfg.dataset, root=cfg.data_root, download=cfg.download,
                     device=strategy.input_device, seq_len=cfg.seq_len)
        train_set = load_split(**split, train=True, augment=cfg.augment, limit=cfg.train_size)
        test_set = load_split(**split, train=False, limit=cfg.test_size)
        dp = strategy.data_parallel_size
        if len(train_set) < dp * cfg.batch_size:
            raise ConfigError(f"the training set has {len(train_set)} samples, fewer than one global batch "
                              f"({dp} ranks × --batch-size {cfg.batch_size}); use fewer ranks or a smaller batch")
        model = kmodels.get_model(cfg.model, num_classes=info.num_classes, in_channels=info.in_channels,
                                  image_size=info.image_size, sequential=strategy.sequential_model,
                                  seq_len=cfg.seq_len or DEFAULT_SEQ_LEN, dropout=cfg.dropout,
                                  recompute=cfg.recompute)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)  # before DDP/partitioning take views of the weights
        # counted on a meta copy of the model as it will train (activation checkpointing included), before placement
        flops = _count_flops(cfg, info, model, env)
        model = strategy.prepare(model)
        lr = cfg.base_lr * (dp if cfg.scale_lr else 1)
        optimizer, preconditioner = strategy.build_optimizer(model, OptimizerSpec(
            cfg.optimizer, lr, cfg.momentum, cfg.weight_decay, cfg.optim_options, env))
        pin = strategy.input_device.type == "cuda"  # --loader torch: pinned batches make non_blocking copies async
        train_loader = loaders.make_loader(train_set, cfg.batch_size, shuffle=True,
                                         sampler=strategy.sampler(train_set, True, cfg.seed), seed=cfg.seed,
                                         drop_last=dp > 1, num_workers=cfg.num_workers, pin_memory=pin)
        test_loader = loaders.make_loader(test_set, cfg.test_batch_size, shuffle=False, pin_memory=pin,
                                        sampler=strategy.sampler(test_set, False, cfg.seed), num_workers=cfg.num_workers)
        steps = len(train_loader) if cfg.max_steps is None else min(cfg.max_steps, len(train_loader))
        if cfg.steps is not None:  # the run's length in steps: as many epochs as they take, the last one cut short
            cfg.epochs = -(-cfg.steps // steps)
        total = cfg.steps if cfg.steps is not None else steps * cfg.epochs
        warmup_start = 1 / dp if cfg.scale_lr and dp > 1 else 1 / max(1.0, cfg.warmup_epochs * steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
            s, steps, cfg.lr_decay, cfg.lr_decay_factor, cfg.warmup_epochs, warmup_start))
        out_dir = cfg.out_dir
        writer = RunWriter(out_dir, enabled=env.is_main, append=cfg.resume)
        ckpt = checkpoint_path(out_dir, strategy)
        start_epoch, position, resumed_at = 0, None, None
        if cfg.resume and checkpoint_on_every_rank(ckpt, strategy):
            state = load_training_state(ckpt, strategy, model, optimizer, scheduler, preconditioner, asdict(cfg))
            start_epoch, position = state["epoch"], state.get("position")
            resumed_at = {"epoch": start_epoch, "step": position["step"] if position else 0}
            source = (f"{out_dir} (written on {state['resharded_from']}, resharded)" if state.get("resharded_from")
                      else ckpt)
            print0(f"resumed from {source} {where(start_epoch, resumed_at['step'])}")
        joined = strategy.join(model, optimizer, scheduler)  # a replica joining a live run: its peers' state
        if joined is not None:
            start_epoch, position = joined["epoch"], joined["position"]
            resumed_at = {"epoch": start_epoch, "step": position["step"] if position else 0}
        writer.log(attempt_started(resumed_at))

        def save(epochs_done: int, position: dict | None = None) -> None:
            """The checkpoint after ``epochs_done`` epochs and, mid-epoch, ``position`` in the next one."""
            if cfg.checkpoint:
                save_training_state(ckpt, strategy, model, optimizer, scheduler, preconditioner,
                                    {"epoch": epochs_done, "position": position}, asdict(cfg))

        if not env.distributed and spread_over_ranks(cfg.strategy):  # legitimate, but rarely what was meant
            print0(f"note: one process, so --strategy {cfg.strategy} runs on 1 rank; for N ranks start it with "
                   f"torchrun --nproc_per_node N -m labkit train --strategy {cfg.strategy} ... (or srun)")
        print0(f"labkit train | {cfg.model} on {cfg.dataset} | strategy {cfg.strategy} | {env.world_size} rank(s) "
               f"on {env.device} | batch {cfg.batch_size}/rank, {cfg.batch_size * dp} global | lr {lr:g} | "
               f"{steps} steps/epoch, {cfg.epochs} epoch(s), {total} steps in all")
        utilisation, flops = _flop_utilisation(cfg, flops, strategy, env)
        started = time.perf_counter()
        monitor = UtilisationMonitor(interval_s=1.0, gpus=nvml_indices(strategy.devices()))
        with _profiler(cfg.profile, out_dir, env.rank) as prof, monitor, _stop_signals(cfg.checkpoint) as stop:
            try:
                history = fit(model, train_loader, test_loader, optimizer, epochs=cfg.epochs, strategy=strategy,
                              preconditioner=preconditioner, scheduler=scheduler, writer=writer,
                              start_epoch=start_epoch, seed=cfg.seed, max_steps=cfg.max_steps, total_steps=cfg.steps,
                              log_every=cfg.log_every, on_epoch_end=lambda epoch: save(epoch + 1), profiler=prof,
                              amp=cfg.amp, channels_last=cfg.channels_last, position=position, stop=stop,
                              on_stop=save, step_delay_s=cfg.step_delay_s, task=task, utilisation=utilisation)
            except Preempted as stopped:
                name = signal_of_any_rank(stopped.signal_name, env)
                if env.is_main:
                    write_marker(out_dir, stopped.epoch, stopped.step, name)
                writer.log(attempt_stopped(name, stopped.epoch, stopped.step))
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
                   **_quality(history, task.metric),
                   "epochs_run": start_epoch + len(history),  # over every attempt of a resumed run
                   "time_s": time.perf_counter() - started,
                   "throughput_window": {  # the window of samples_per_sec
                       "epoch": last["epoch"], "timed_steps": last["timed_steps"], "seconds": last["window_s"],
                       "barriers": env.distributed and strategy.step_boundary()} if last else None,
                   "global_batch_size": cfg.batch_size * dp, "memory_lines": lines,
                   "mfu": last.get("mfu"), "hfu": last.get("hfu"),
                   "flops": {**flops.as_dict(cfg.batch_size * dp), **utilisation.as_dict(),
                             "model_flops_per_s": last.get("model_flops_per_s")},
                   "utilisation": gather_utilisation(monitor, env, writer)}
        summary = writer.finish(cfg.run_name, "train", asdict(cfg), metrics, env,
                                attempts=attempts(writer.read("attempt"), finished=now_utc()))
        strategy.close()
        print0(f"results written to {out_dir}/summary.json and {out_dir}/metrics.jsonl")
    return summary


_LOCKS_TAKEN = [0]


def _count_flops(cfg: TrainConfig, info, model: torch.nn.Module, env: kdist.DistEnv) -> StepFlops | None:
    """Rank 0: one step's FLOPs per sample (:func:`labkit.train.flops.step_flops`, on a fresh meta-device model: no
    work on the run's model, no random draw; counted once per model and shape, :func:`labkit.train.flops.counted_once`). ``cfg.recompute`` (activation checkpointing) other than ``"none"``:
    the hardware FLOPs are counted on a meta copy of ``model`` as it is here, recompute applied. Other ranks: None."""
    if not env.is_main:
        return None
    recompute = getattr(cfg, "recompute", "none")  # a TrainConfig without --recompute trains without it
    return counted_once(cfg.model, info.num_classes, info.in_channels, info.image_size, cfg.seq_len or DEFAULT_SEQ_LEN,
                      recomputed=model if recompute not in (None, "none") else None)


def _flop_utilisation(cfg: TrainConfig, flops: StepFlops | None, strategy,
                      env: kdist.DistEnv) -> tuple[FlopUtilisation, StepFlops]:
    """MFU and HFU for :func:`labkit.train.loop.fit`: rank 0 finds the device's peak (:func:`labkit.train.peak.
    device_peak`: a datasheet figure, or a matmul measured once and cached) and prints it with the FLOPs; the other
    ranks read both from the job's store (a key, not a collective: the run's collectives keep their numbers), so
    every rank's summary is the same. The job's devices: one per rank, times a one-process pipeline's GPUs."""
    devices = strategy.devices()
    if env.is_main:
        peak = device_peak(devices[0], cfg.amp, convolutional=cfg.model not in LANGUAGE_MODELS)
        count = env.world_size * (len(set(devices)) if devices[0].type == "cuda" else 1)
        shared = {"flops": flops.__dict__, "peak": peak.__dict__, "devices": count}
        print0(f"FLOPs | {flops_text(flops.model)} per sample counted, {flops_text(flops.formula)} by formula"
               + (f", {flops_text(flops.hardware)} with recompute" if flops.hardware != flops.model else "")
               + f" | peak {peak.describe()}" + (f" × {count} devices" if count > 1 else ""))
    if env.distributed:
        shared = json.loads(_from_rank0(env, f"labkit/flops/{_LOCKS_TAKEN[0]}", json.dumps(shared) if env.is_main else ""))
    flops = StepFlops(**shared["flops"])
    return FlopUtilisation(flops.model, flops.hardware, Peak(**shared["peak"]), shared["devices"]), flops


def _lock_out(out_dir: Path, env: kdist.DistEnv, held: contextlib.ExitStack) -> None:
    """Rank 0 locks ``out_dir`` for the run (:func:`labkit.results.run_dir_lock`) and tells the other ranks through
    the job's store (a key, not a collective: the run's collectives keep their numbers), so a second run started on
    the same folder stops at once on every rank, in one line."""
    busy = held.enter_context(run_dir_lock(out_dir)) if env.is_main else None
    if env.distributed:
        _LOCKS_TAKEN[0] += 1  # every rank counts its runs alike: a key per run, never one a run before left
        busy = _from_rank0(env, f"labkit/out-lock/{_LOCKS_TAKEN[0]}/{out_dir}", busy or "") or None
    if busy:
        raise ConfigError(busy)


def _from_rank0(env: kdist.DistEnv, key: str, value: str) -> str:
    """Rank 0's ``value``, on every rank, through the job's store under ``key`` (a key, not a collective: the run's
    collectives keep their numbers); what other ranks pass is not used."""
    store = dist.distributed_c10d._get_default_store()
    if env.is_main:
        store.set(key, value)
    return store.get(key).decode()


@contextlib.contextmanager
def _given(env: kdist.DistEnv, seed: int):
    kdist.seed_everything(seed)
    yield env


def _quality(history: list[dict], metric: str) -> dict:
    """The summary's final and best test metric (accuracy, or loss and perplexity) and final training loss."""
    last = history[-1] if history else {}
    if metric == "acc":
        return {"final_test_acc": last.get("test_acc"), "final_train_loss": last.get("train_loss"),
                "best_test_acc": max((r["test_acc"] for r in history), default=None)}
    return {"final_test_loss": last.get("test_loss"), f"final_test_{metric}": last.get(f"test_{metric}"),
            "final_train_loss": last.get("train_loss"),
            f"best_test_{metric}": min((r[f"test_{metric}"] for r in history), default=None),
            "tokens_per_sec": last.get("tokens_per_sec")}


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

"""DDP scaling (samples/s, speedup, efficiency over 1, 2, 4 ranks) and labkit's DDP trainer vs plain PyTorch DDP.

    labkit bench ddp --ranks 1,2,4                       # scaling sweep + the labkit/plain comparison
    labkit bench ddp --ranks 1,2 --compare-ranks 0       # sweep only
    labkit bench ddp --model resnet20 --dataset synthetic-cifar10 --device cuda --ranks 1,2,4,8

Scaling is weak scaling: every rank keeps --batch-size, so the global batch grows with the ranks.
speedup(n) = throughput(n) / throughput(1); efficiency(n) = speedup(n) / n (1.0 = perfect). Each rank
count is one `labkit train --strategy ddp` run under torchrun.

The comparison starts --compare-ranks ranks once (gloo on CPU); inside that one run every rank alternates the
contenders round by round (:mod:`labkit.bench.harness`) on the same model, data and batch, each call
--compare-epochs whole epochs: labkit = labkit.train.loop.fit with the DDP strategy and ``--loader``'s data path, with
what ``labkit train`` adds around a step (scheduler, stop signals, utilisation monitor); zero-2 = the same with
``--strategy zero --zero-stage 2``; plain = DistributedDataParallel over the dataset preloaded as one tensor,
each rank slicing its shard of a shared permutation. A ratio to plain is the median over rounds of each
back-to-back pair, so noise from other programs on the machine mostly cancels. Target: labkit/plain >= 0.97.
"""
from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from labkit.data import loader as loaders
from labkit.errors import ConfigError

TARGET = 0.97


#: ``labkit bench ddp`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--ranks", "default": "1,2,4", "help": "rank counts of the scaling sweep, e.g. 1,2,4"},
    {"flag": "--compare-ranks", "type": "int", "range": "[0, inf)", "default": 2,
     "help": "ranks of the labkit/plain comparison (0: skip)"},
    {"flag": "--model", "default": "lenet", "help": "labkit model"},
    {"flag": "--dataset", "default": "mnist-sample", "help": "dataset"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 64, "help": "samples per rank per step"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 30,
     "help": "optimizer steps per run / per contender and round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 8,
     "help": "comparison rounds (each runs every contender)"},
    {"flag": "--compare-epochs", "type": "int", "range": "[1, inf)", "default": 3,
     "help": "whole epochs per contender call in the comparison"},
    {"flag": "--loader", "default": "tensor", "choices": ["tensor", "torch"], "help": "labkit's data path"},
    {"flag": "--repeat", "type": "int", "range": "[1, inf)", "default": 1,
     "help": "runs per rank count, alternating; the median counts"},
    {"flag": "--device", "default": "cpu", "help": "cpu (gloo) or cuda (NCCL, one rank per GPU)"},
    {"flag": "--threads", "type": "int", "range": "[1, inf)", "default": 1,
     "help": "CPU threads per rank (1: on a CPU each rank stands for one device of one core)"},
    {"flag": "--out", "default": "runs/bench-ddp", "help": "results folder"},
    {"flag": "--compare-worker", "action": "store_true", "hidden": True, "help": "one rank of the comparison"},
]


def parse_ranks(spec: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; anything else is a ConfigError."""
    try:
        ranks = sorted({int(s) for s in spec.split(",") if s.strip()})
    except ValueError:
        raise ConfigError(f"--ranks {spec!r} is not a comma list of rank counts; e.g. --ranks 1,2,4") from None
    if not ranks or ranks[0] < 1 or ranks[-1] > 64:  # ranks started on this machine
        raise ConfigError(f"--ranks {spec!r} needs rank counts >= 1 and <= 64; e.g. --ranks 1,2,4")
    return ranks


def scaling_rows(rates: dict[int, float]) -> list[dict]:
    """Speedup and efficiency from ``{ranks: samples/s}``, relative to the smallest rank count."""
    base_n = min(rates)
    rows = []
    for n in sorted(rates):
        speedup = rates[n] / rates[base_n]
        rows.append({"kind": "bench", "ranks": n, "samples_per_sec": rates[n], "speedup": speedup,
                     "efficiency": speedup / (n / base_n)})
    return rows


def plot_scaling(rows: list[dict], path: str | Path | None = None):
    """Throughput, speedup (with the ideal line) and efficiency against the number of ranks."""
    import matplotlib.pyplot as plt

    from labkit.viz.figcheck import legend_beside

    n = [r["ranks"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    axes[0].plot(n, [r["samples_per_sec"] for r in rows], marker="o")
    axes[0].set_ylabel("samples/s (all ranks)")
    axes[0].set_ylim(bottom=0)
    axes[1].plot(n, [r["speedup"] for r in rows], marker="o", label="measured")
    axes[1].plot(n, [k / n[0] for k in n], "--", color="gray", label="ideal")
    axes[1].set_ylabel("speedup")
    legend_beside(axes[1])  # measured speedup: no place inside is free in every run
    axes[2].plot(n, [r["efficiency"] for r in rows], marker="o")
    axes[2].axhline(1.0, ls="--", color="gray")
    axes[2].set_ylabel("efficiency")
    axes[2].set_ylim(0, 1.1)
    for ax in axes:
        ax.set_xlabel("ranks")
        ax.set_xticks(n)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def main(args: argparse.Namespace) -> int:
    if args.compare_worker:
        return _compare_worker(args)
    from labkit.launch.local import torchrun
    from labkit.results import RunWriter

    ranks = parse_ranks(args.ranks)
    out = Path(args.out)
    common = ["--model", args.model, "--dataset", args.dataset, "--batch-size", str(args.batch_size),
              "--device", args.device]
    if args.repeat < 1 or args.steps < 3 or args.rounds < 1 or args.threads < 1 or args.compare_epochs < 1:
        raise ConfigError(f"need --repeat >= 1, --steps >= 3, --rounds >= 1, --threads >= 1, --compare-epochs >= 1; "
                          f"got {args.repeat}, {args.steps}, {args.rounds}, {args.threads}, {args.compare_epochs}")
    env = {"OMP_NUM_THREADS": str(args.threads)}
    measured: dict[int, list[float]] = {n: [] for n in ranks}
    for r in range(args.repeat):
        for n in ranks if r % 2 == 0 else ranks[::-1]:  # alternate the order: slow drifts hit all alike
            print(f"--- {n} rank(s): labkit train --strategy ddp, {args.steps} steps", flush=True)
            run = torchrun(["train", "--strategy", "ddp", *common, "--epochs", "1", "--max-steps", str(args.steps),
                            "--test-size", "64", "--no-checkpoint", "--log-every", str(10 ** 6), "--out",
                            str(out / f"ranks{n}-{r}")], nproc=n, env=env, echo=_quiet)
            measured[n].append(run.summary["metrics"]["samples_per_sec"])
    rows = scaling_rows({n: statistics.median(v) for n, v in measured.items()})
    metrics = {"samples_per_sec": {r["ranks"]: r["samples_per_sec"] for r in rows},
               "speedup": {r["ranks"]: r["speedup"] for r in rows},
               "efficiency": {r["ranks"]: r["efficiency"] for r in rows}}
    if args.compare_ranks:
        print(f"--- labkit vs plain PyTorch DDP on {args.compare_ranks} ranks, {args.rounds} rounds", flush=True)
        compare = torchrun(["bench", "ddp", "--compare-worker", *common, "--compare-epochs", str(args.compare_epochs),
                            "--loader", args.loader, "--rounds", str(args.rounds), "--out", str(out / "compare")],
                           nproc=args.compare_ranks, env=env, echo=_quiet)
        metrics.update(compare.summary["metrics"])
    writer = RunWriter(out)
    for row in rows:
        writer.log(row)
    plot_scaling(rows, out / "scaling.png")
    print(f"\n{'ranks':>5} {'samples/s':>11} {'speedup':>8} {'efficiency':>10}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['samples_per_sec']:>11.1f} {r['speedup']:>8.2f} {r['efficiency']:>10.2f}")
    if args.compare_ranks:
        print(f"labkit {metrics['labkit_samples_per_sec']:.1f} vs plain {metrics['plain_samples_per_sec']:.1f} "
              f"samples/s on {args.compare_ranks} ranks; ratio labkit/plain (median of "
              f"{args.rounds} paired rounds) = {metrics['ratio']:.3f} (target >= 0.97); zero-2/plain "
              f"{metrics['zero-2']['ratio']:.3f}")
    config = {k: v for k, v in vars(args).items() if k not in ("func", "compare_worker")}
    writer.finish("bench-ddp", "bench", config, metrics)
    print(f"results written to {out}/summary.json, plot {out}/scaling.png")
    return 0


def _quiet(line: str) -> None:
    """Pass on the throughput lines and errors of a launched run, not every log line."""
    if "samples/sec" in line or "error" in line.lower():
        print("   ", line, flush=True)


def _compare_worker(args: argparse.Namespace) -> int:
    """One rank of the comparison: labkit's DDP and ZeRO-2 strategies through fit vs DDP over preloaded tensors."""
    from labkit.bench.contenders import PlainLoop, labkit_fit, preload
    from labkit.bench.harness import alternate, config_of
    from labkit.data import datasets as data
    from labkit.data.tensor import load_split
    from labkit.dist.group import distributed, print0
    from labkit.models import cnn as models
    from labkit.parallel.ddp import DDPStrategy
    from labkit.parallel.zero import ZeroStrategy
    from labkit.results import RunWriter

    with distributed(args.device) as env:
        info = data.dataset_info(args.dataset)
        torch.manual_seed(0)
        template = models.get_model(args.model, info.num_classes, info.in_channels, info.image_size)
        train_set = load_split(args.loader, args.dataset, True, device=env.device)
        contenders = {}
        for name, strategy in (("labkit", DDPStrategy(env, {})), ("zero-2", ZeroStrategy(env, {"zero_stage": 2}))):
            model = strategy.prepare(copy.deepcopy(template))
            loader = loaders.make_loader(train_set, args.batch_size, shuffle=True, drop_last=True,
                                      sampler=strategy.sampler(train_set, True, 0))
            contenders[name] = labkit_fit(model, loader, strategy, None, epochs=args.compare_epochs, as_train=True)
        x, y = preload(args.dataset, env.device)
        plain = DistributedDataParallel(copy.deepcopy(template).to(env.device),
                                        device_ids=[env.device.index] if env.device.type == "cuda" else None)
        epoch = PlainLoop(plain, x, y, args.batch_size, len(loader), env.rank, env.world_size)  # the same steps
        contenders["plain"] = lambda: sum(epoch() for _ in range(args.compare_epochs))
        writer = RunWriter(args.out, enabled=env.is_main)
        results = alternate(contenders, args.rounds, [env.device], log=lambda r: writer.log({**r, "ranks": env.world_size}))
        print0(results.table("plain", TARGET))
        summary = results.summary("plain")
        writer.finish("bench-ddp-compare", "bench", config_of(args),
                      {**summary, "labkit_samples_per_sec": summary["labkit"]["median_samples_per_sec"],
                       "plain_samples_per_sec": summary["plain"]["median_samples_per_sec"],
                       "ratio": summary["labkit"]["ratio"], "zero2_ratio": summary["zero-2"]["ratio"],
                       "compare_ranks": env.world_size, "compare_epochs": args.compare_epochs}, env)
    return 0

"""labkit's training loop vs a plain-PyTorch loop on preloaded tensors: same model, data and batch, one process.

    labkit bench single --model lenet --dataset mnist-sample --batch-size 64 --steps 40 --rounds 8

labkit = ``labkit.train.fit`` on the single-device strategy with ``--loader`` (default: the resident tensor
path); plain = the textbook loop over the dataset preloaded as one normalised tensor. Both start from the
same weights and alternate round by round (:mod:`labkit.bench.harness`); the result is the median of the
per-round ratios labkit / plain (target >= 0.97).
"""
from __future__ import annotations

import argparse
import copy

import torch

from labkit.bench.harness import alternate, config_of

TARGET = 0.97


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="lenet")
    p.add_argument("--dataset", default="mnist-sample")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per contender per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--loader", default="tensor", choices=("tensor", "torch"), help="labkit's data path")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: one core stands for one device)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="runs/bench-single")


def run_compare(args: argparse.Namespace, writer=None) -> dict:
    """Alternate labkit and plain; return ``summary.json`` metrics (see :meth:`Results.summary`)."""
    from labkit import data, models
    from labkit.bench.contenders import PlainLoop, labkit_fit, preload
    from labkit.dist import DistEnv, resolve_device
    from labkit.strategies import Strategy
    from labkit.tensor_data import load_split

    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    info = data.dataset_info(args.dataset)
    torch.manual_seed(0)
    template = models.get_model(args.model, info.num_classes, info.in_channels, info.image_size).to(device)
    strategy = Strategy(DistEnv(device=device))
    loader = data.make_loader(load_split(args.loader, args.dataset, True, device=device), args.batch_size,
                              shuffle=True, drop_last=True)
    x, y = preload(args.dataset, device)
    contenders = {"labkit": labkit_fit(copy.deepcopy(template), loader, strategy, args.steps),
                  "plain": PlainLoop(copy.deepcopy(template), x, y, args.batch_size, args.steps)}
    results = alternate(contenders, args.rounds, [device], log=writer.log if writer else None)
    print(results.table("plain", TARGET))
    return {**results.summary("plain"), "ratio": results.summary("plain")["labkit"]["ratio"]}


def main(args: argparse.Namespace) -> int:
    from labkit.dist import DistEnv, resolve_device
    from labkit.results import RunWriter

    writer = RunWriter(args.out)
    metrics = run_compare(args, writer)
    writer.finish("bench-single", "bench", config_of(args), metrics, DistEnv(device=resolve_device(args.device)))
    print(f"results written to {args.out}/summary.json")
    return 0

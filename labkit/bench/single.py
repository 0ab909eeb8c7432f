"""labkit's training loop vs a plain-PyTorch loop on preloaded tensors: same model, data and batch, one process.

    labkit bench single --model lenet --dataset mnist-sample --batch-size 64 --steps 60 --rounds 16

labkit = ``labkit.train.loop.fit`` on the single-device strategy with ``--loader`` (default: the resident tensor
path); plain = the textbook loop over the dataset preloaded as one normalised tensor. Both start from the
same weights and alternate round by round (:mod:`labkit.bench.harness`); the result is the median of the
per-round ratios labkit / plain (target >= 0.97).
"""
from __future__ import annotations

import argparse
import copy

import torch

from labkit.bench.harness import alternate, config_of
from labkit.data import loader as loaders

TARGET = 0.97


#: ``labkit bench single`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--model", "default": "lenet", "help": "labkit model"},
    {"flag": "--dataset", "default": "mnist-sample", "help": "dataset"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 64, "help": "samples per step"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 60,
     "help": "optimizer steps per contender per round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 16,
     "help": "timed rounds, each running both contenders (the median of many is steadier than a few)"},
    {"flag": "--loader", "default": "tensor", "choices": ["tensor", "torch"], "help": "labkit's data path"},
    {"flag": "--threads", "type": "int", "range": "[1, inf)", "default": 1,
     "help": "CPU threads (1: one core stands for one device)"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": "runs/bench-single", "help": "results folder"},
]


def run_compare(args: argparse.Namespace, writer=None) -> dict:
    """Alternate labkit and plain; return ``summary.json`` metrics (see :meth:`Results.summary`)."""
    from labkit.bench.contenders import PlainLoop, labkit_fit, preload
    from labkit.data import datasets as data
    from labkit.data.tensor import load_split
    from labkit.dist.group import DistEnv
    from labkit.dist.launch_info import resolve_device
    from labkit.models import cnn as models
    from labkit.strategies.base import Strategy

    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    info = data.dataset_info(args.dataset)
    torch.manual_seed(0)
    template = models.get_model(args.model, info.num_classes, info.in_channels, info.image_size).to(device)
    strategy = Strategy(DistEnv(device=device))
    loader = loaders.make_loader(load_split(args.loader, args.dataset, True, device=device), args.batch_size,
                              shuffle=True, drop_last=True)
    x, y = preload(args.dataset, device)
    contenders = {"labkit": labkit_fit(copy.deepcopy(template), loader, strategy, args.steps),
                  "plain": PlainLoop(copy.deepcopy(template), x, y, args.batch_size, args.steps)}
    results = alternate(contenders, args.rounds, [device], log=writer.log if writer else None)
    print(results.table("plain", TARGET))
    return {**results.summary("plain"), "ratio": results.summary("plain")["labkit"]["ratio"]}


def main(args: argparse.Namespace) -> int:
    from labkit.dist.group import DistEnv
    from labkit.dist.launch_info import resolve_device
    from labkit.results import RunWriter

    writer = RunWriter(args.out)
    metrics = run_compare(args, writer)
    writer.finish("bench-single", "bench", config_of(args), metrics, DistEnv(device=resolve_device(args.device)))
    print(f"results written to {args.out}/summary.json")
    return 0

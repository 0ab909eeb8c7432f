"""The data path against its upper bound: how close does training get to the model's own speed?

    labkit bench datapath                                    # ResNet-32, CIFAR-shaped, augmented, this device
    labkit bench datapath --device cuda --amp bf16 --channels-last --batch-size 256

Contenders, alternated round by round (:mod:`labkit.bench.harness`), all training the same model from the
same weights with SGD through :func:`labkit.train.loop.fit`:

- ``torch loader``: torchvision's per-sample DataLoader (decode, normalise, crop and flip one image at a time);
- ``tensor loader``: the dataset resident on the device, batches gathered, normalised and augmented at once;
- ``model only``: one fixed batch already on the device, so nothing but forward, backward and the step - the
  bound no data path can beat.

The figure of merit is ``tensor loader / model only`` (1.0 = the data path costs nothing).
"""
from __future__ import annotations

import argparse
import copy

import torch

from labkit.bench.harness import alternate, config_of
from labkit.data.loader import make_loader

#: ``labkit bench datapath`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--model", "default": "resnet32", "help": "labkit model"},
    {"flag": "--dataset", "default": "synthetic-cifar10", "help": "dataset (cifar10 where it is on disk)"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 128, "help": "samples per step"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 10, "help": "steps per contender per round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 5,
     "help": "timed rounds (each runs every contender)"},
    {"flag": "--no-augment", "dest": "augment", "action": "store_false", "help": "no crop + flip"},
    {"flag": "--amp", "default": None, "choices": ["bf16"], "help": "bfloat16 autocast for every contender"},
    {"flag": "--channels-last", "action": "store_true", "help": "NHWC model and batches for every contender"},
    {"flag": "--threads", "type": "int", "range": "[1, inf)", "default": None,
     "help": "CPU threads (default: torch's choice)"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": "runs/bench-datapath", "help": "results folder"},
]


def run_datapath(args: argparse.Namespace, writer=None) -> dict:
    """Alternate the three contenders; return summary metrics with ratios to ``model only``."""
    from labkit.bench.contenders import labkit_fit
    from labkit.data import datasets as data
    from labkit.data.tensor import load_split
    from labkit.dist.group import DistEnv
    from labkit.dist.launch_info import resolve_device
    from labkit.models import cnn as models
    from labkit.strategies.base import Strategy

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = data.dataset_info(args.dataset)
    torch.manual_seed(0)
    template = models.get_model(args.model, info.num_classes, info.in_channels, info.image_size)
    if args.channels_last:
        template = template.to(memory_format=torch.channels_last)
    strategy = Strategy(DistEnv(device=device))
    options = {"amp": args.amp, "channels_last": args.channels_last}
    loaders = {name: make_loader(load_split(kind, args.dataset, True, augment=args.augment, device=device),
                                      args.batch_size, shuffle=True, drop_last=True)
               for name, kind in (("torch loader", "torch"), ("tensor loader", "tensor"))}
    fixed = next(iter(loaders["tensor loader"]))
    loaders["model only"] = _Repeat(fixed, args.steps, args.batch_size)
    contenders = {name: labkit_fit(copy.deepcopy(template).to(device), loader, strategy, args.steps, **options)
                  for name, loader in loaders.items()}
    results = alternate(contenders, args.rounds, [device], log=writer.log if writer else None)
    print(f"{args.model} on {args.dataset}, batch {args.batch_size}, augment {args.augment}, amp {args.amp}, "
          f"channels-last {args.channels_last}, {device}")
    print(results.table("model only"))
    return results.summary("model only")


class _Repeat(list):
    """``steps`` times the same device batch, with the ``batch_size`` a loader has."""

    def __init__(self, batch, steps: int, batch_size: int):
        super().__init__([batch] * steps)
        self.batch_size = batch_size


def main(args: argparse.Namespace) -> int:
    from labkit.dist.group import DistEnv
    from labkit.dist.launch_info import resolve_device
    from labkit.results import RunWriter

    writer = RunWriter(args.out)
    metrics = run_datapath(args, writer)
    writer.finish("bench-datapath", "bench", config_of(args), metrics, DistEnv(device=resolve_device(args.device)))
    print(f"results written to {args.out}/summary.json")
    return 0

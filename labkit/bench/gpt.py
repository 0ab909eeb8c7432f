"""labkit's training loop vs a plain-PyTorch loop on a GPT: same model, token windows and batch, one process.

    labkit bench gpt --model gpt-tiny --seq-len 128 --batch-size 16 --steps 10 --rounds 12

labkit = ``labkit.train.loop.fit`` with the language-modelling task (:mod:`labkit.train.tasks`) on the single-device
strategy and the resident token windows of ``text-sample`` (:class:`labkit.data.text.TensorTokens`); plain = the
textbook loop over the same windows: a permutation, slices, ``cross_entropy(logits.view(-1, V), y.view(-1))``,
backward, step. Both start from the same weights with the same optimizer (SGD, momentum 0.9) and alternate round
by round (:mod:`labkit.bench.harness`); the result is the median of the per-round ratios labkit / plain (target
>= 0.95). Rates are sequences (samples) per second; tokens per second are ``--seq-len`` times them.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

from labkit.bench.harness import alternate, config_of
from labkit.data import loader as loaders
from labkit.errors import ConfigError

TARGET = 0.95

#: ``labkit bench gpt`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--model", "default": "gpt-tiny", "help": "gpt, gpt-tiny, gpt-small or gpt-100m"},
    {"flag": "--dataset", "default": "text-sample", "help": "text dataset"},
    {"flag": "--seq-len", "type": "int", "range": "[1, 65536]", "default": 128, "help": "tokens per sequence"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 16, "help": "sequences per step"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 10,
     "help": "optimizer steps per contender per round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 12,
     "help": "timed rounds, each running both contenders (the median of many is steadier than a few)"},
    {"flag": "--threads", "type": "int", "range": "[1, inf)", "default": 1,
     "help": "CPU threads (1: one core stands for one device)"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": "runs/bench-gpt", "help": "results folder"},
]


class PlainLM:
    """``steps`` textbook next-token steps per call over windows ``x``, ``y`` (N, T); returns the sequences."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, steps: int,
                 lr: float = 0.01, seed: int = 0):
        if steps * batch_size > len(x):
            raise ConfigError(f"{steps} steps of {batch_size} sequences need {steps * batch_size} windows; the "
                              f"dataset has {len(x)}: use fewer --steps")
        self.model, self.x, self.y, self.batch_size, self.steps = model, x, y, batch_size, steps
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self) -> int:
        order = torch.randperm(len(self.x), generator=self.generator).to(self.x.device)
        self.model.train()
        b = self.batch_size
        for i in range(self.steps):
            index = order[i * b:(i + 1) * b]
            x, y = self.x[index], self.y[index]  # (B, T) each
            self.optimizer.zero_grad(set_to_none=True)
            logits = self.model(x)  # (B, T, V)
            F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
            self.optimizer.step()
        return self.steps * b


def run_compare(args: argparse.Namespace, writer=None) -> dict:
    """Alternate labkit and plain; return ``summary.json`` metrics (see :meth:`Results.summary`)."""
    from labkit.bench.contenders import labkit_fit
    from labkit.data import datasets as data
    from labkit.data.text import text_split
    from labkit.dist.group import DistEnv
    from labkit.dist.launch_info import resolve_device
    from labkit.models import cnn as models
    from labkit.models import names
    from labkit.strategies.base import Strategy
    from labkit.train.tasks import get_task

    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    info = data.dataset_info(args.dataset)
    if info.task != "lm" or args.model not in names.LANGUAGE_MODELS:
        raise ConfigError(f"labkit bench gpt needs a language model on a text dataset, got --model {args.model} "
                          f"--dataset {args.dataset}")
    torch.manual_seed(0)
    template = models.get_model(args.model, info.num_classes, seq_len=args.seq_len).to(device)
    windows = text_split(args.dataset, True, data.data_root(), args.seq_len, device=device)
    loader = loaders.make_loader(windows, args.batch_size, shuffle=True, drop_last=True)
    strategy = Strategy(DistEnv(device=device))
    contenders = {"labkit": labkit_fit(copy.deepcopy(template), loader, strategy, args.steps, task=get_task("lm")),
                  "plain": PlainLM(copy.deepcopy(template), windows.data, windows.targets, args.batch_size,
                                   args.steps)}
    results = alternate(contenders, args.rounds, [device], log=writer.log if writer else None)
    print(results.table("plain", TARGET))
    summary = results.summary("plain")
    return {**summary, "ratio": summary["labkit"]["ratio"],
            "tokens_per_sec": {name: summary[name]["median_samples_per_sec"] * args.seq_len
                               for name in contenders}}


def main(args: argparse.Namespace) -> int:
    from labkit.dist.group import DistEnv
    from labkit.dist.launch_info import resolve_device
    from labkit.results import RunWriter

    writer = RunWriter(args.out)
    metrics = run_compare(args, writer)
    writer.finish("bench-gpt", "bench", config_of(args), metrics, DistEnv(device=resolve_device(args.device)))
    print(f"labkit / plain = {metrics['ratio']:.3f} (target >= {TARGET}); tokens/s: "
          + ", ".join(f"{k} {v:.0f}" for k, v in metrics["tokens_per_sec"].items()))
    print(f"results written to {args.out}/summary.json")
    return 0

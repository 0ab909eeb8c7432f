"""``labkit train``: command-line front of :func:`labkit.train.run`.

Strategy and optimizer modules add their own flags (``--allreduce``, ``--num-microbatches``,
``--kfac-update-freq``, ...); they are collected here into ``strategy_options`` / ``optim_options``.
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import fields

from labkit.data_cli import ROOT_HELP
from labkit.strategies import STRATEGIES

_OPTIONAL_GROUPS: dict[str, str] = {name: target.partition(":")[0] for name, target in STRATEGIES.items()}


def _optional_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model with a parallel strategy",
                       description="Train a model with a parallel strategy through labkit's one training loop. "
                       "Under torchrun or srun every rank runs this same command.")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="lenet", help="mlp, lenet, resnet20, resnet32, resnet50, alexnet_small")
    g.add_argument("--dataset", default="mnist-sample",
                   help="mnist, cifar10, mnist-sample, synthetic-mnist, synthetic-cifar10")
    g.add_argument("--data-root", default=None, help=ROOT_HELP)
    g.add_argument("--download", action="store_true", help="download the dataset if missing (needs internet)")
    g.add_argument("--augment", action="store_true", help="random crop + flip (CIFAR10)")
    g.add_argument("--train-size", type=int, default=None, help="use only the first N training samples")
    g.add_argument("--test-size", type=int, default=None, help="use only the first N test samples")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes (--loader torch)")
    g.add_argument("--loader", default="tensor", choices=("tensor", "torch"),
                   help="tensor: the dataset resident on the training device, batches normalised and augmented "
                        "at once (default); torch: torchvision's per-sample DataLoader (data too big for memory)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=1)
    g.add_argument("--batch-size", type=int, default=64, help="per data-parallel rank")
    g.add_argument("--test-batch-size", type=int, default=512)
    g.add_argument("--optimizer", default="sgd", help="sgd, adam, lars, lamb, kfac (K-FAC preconditioning --kfac-base)")
    g.add_argument("--base-lr", type=float, default=0.05)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--lr-decay", type=int, nargs="*", default=[], metavar="EPOCH",
                   help="multiply the LR by --lr-decay-factor at these epochs, e.g. 35 75 90")
    g.add_argument("--lr-decay-factor", type=float, default=0.1)
    g.add_argument("--warmup-epochs", type=float, default=0.0, help="linear LR warm-up (Goyal et al.)")
    g.add_argument("--scale-lr", action="store_true", help="linear scaling: LR × number of data-parallel ranks")
    g.add_argument("--max-steps", type=int, default=None, help="stop each epoch after N steps")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--amp", default=None, choices=("bf16",),
                   help="mixed precision: forward passes under bfloat16 autocast (CPU and CUDA); default float32")
    g.add_argument("--channels-last", action="store_true",
                   help="NHWC memory layout for conv models and their input batches (faster conv kernels)")
    g = p.add_argument_group("where and how")
    g.add_argument("--strategy", default="single", help=", ".join(STRATEGIES))
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--backend", default=None, help="nccl or gloo (default: nccl on GPUs, gloo on CPU)")
    g.add_argument("--timeout-s", type=float, default=1800.0, help="collective timeout: a dead rank fails the job")
    g.add_argument("--out", default=None, help="results folder (default runs/<model>-<dataset>-<strategy>-<optim>)")
    g.add_argument("--name", default=None, help="run name in the results")
    g.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt if present")
    g.add_argument("--no-checkpoint", dest="checkpoint", action="store_false", help="do not write checkpoints")
    g.add_argument("--profile", action="store_true", help="write a torch.profiler trace to <out>/profile")
    g.add_argument("--log-every", type=int, default=20, help="print an estimated throughput line every N steps")

    owned: dict[str, list[str]] = {"strategy": [], "optim": []}
    for module_name in dict.fromkeys(_OPTIONAL_GROUPS.values()):
        module = _optional_module(module_name)
        cls = next((getattr(module, t.partition(":")[2]) for t in STRATEGIES.values()
                    if module and t.startswith(module_name + ":")), None)
        if cls is not None:
            before = {a.dest for a in p._actions}
            cls.add_arguments(p.add_argument_group(f"strategy {cls.name}"))
            owned["strategy"] += [a.dest for a in p._actions if a.dest not in before]
    if _optional_module("labkit.optim.kfac") is not None:
        before = {a.dest for a in p._actions}
        importlib.import_module("labkit.optim").add_arguments(p.add_argument_group("K-FAC"))
        owned["optim"] += [a.dest for a in p._actions if a.dest not in before]
    p.set_defaults(func=lambda a: _run(a, owned))


def config_from_args(args: argparse.Namespace, owned: dict[str, list[str]]):
    from labkit.train import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    cfg.strategy_options = {k: getattr(args, k) for k in owned["strategy"]}
    cfg.optim_options = {k: getattr(args, k) for k in owned["optim"]}
    return cfg


def _run(args: argparse.Namespace, owned: dict[str, list[str]]) -> int:
    from labkit.train import run

    run(config_from_args(args, owned))
    return 0

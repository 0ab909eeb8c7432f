"""``labkit train``: command-line front of :func:`labkit.train.run.run`.

The parser reads ``--strategy`` and ``--optimizer`` first, then adds only that strategy's flags (its
module's ``FLAGS``, see :mod:`labkit.flags`) and that optimizer's (``labkit.optim.OPTIMIZERS``). A flag of
another strategy or optimizer is refused with one line naming its owner. Nothing here imports torch, so
``--help`` and flag errors answer at once; torch loads when training starts.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from labkit.data.cli import ROOT_HELP
from labkit.dist.mesh import MeshShape
from labkit.errors import ConfigError, flag_error
from labkit.flags import add_flags
from labkit.models.names import RECOMPUTE, default_optimizer
from labkit.optim import OPTIMIZERS
from labkit.optim import add_arguments as add_optimizer_arguments
from labkit.parallel import available as available_dimensions
from labkit.parallel import dimension_flags
from labkit.ranges import within
from labkit.strategies import STRATEGIES, strategy_flags
from labkit.train.config import NUMBERS


def _number(dest: str):
    return within(*NUMBERS[dest])


class TrainParser(argparse.ArgumentParser):
    """Adds the chosen strategy's and optimizer's flags before parsing; refuses everyone else's by name."""

    chosen: tuple[str, str] | None = None

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        peek.add_argument("--strategy", default=None)
        peek.add_argument("--optimizer", default=None)  # None: the model's (sgd or adam: no flags of their own)
        peek.add_argument("--model", default="lenet")
        peek.add_argument("--mesh", default=None)
        peek.add_argument("--ft-replicas", default=None)
        chosen, _ = peek.parse_known_args(args)
        chosen.optimizer = chosen.optimizer or default_optimizer(chosen.model)
        if chosen.ft_replicas is not None and chosen.strategy in (None, "ft"):  # --ft-replicas means --strategy ft
            args = args if chosen.strategy == "ft" else [*args, "--strategy", "ft"]
            chosen.strategy = "ft"
        if chosen.strategy is None:  # --mesh alone means --strategy mesh
            chosen.strategy = "single" if chosen.mesh is None else "mesh"
            args = args if chosen.mesh is None else [*args, "--strategy", "mesh"]
        if chosen.mesh is not None and chosen.strategy in ("mesh", "ft"):
            try:
                MeshShape.parse(chosen.mesh)
            except ConfigError as exc:
                self.error(str(exc))
        if chosen.strategy not in STRATEGIES:
            self.error(f"unknown strategy {chosen.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if chosen.optimizer not in OPTIMIZERS:
            self.error(f"unknown optimizer {chosen.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
        self._add_owned(chosen.strategy, chosen.optimizer)
        if chosen.strategy == "single" and {"-h", "--help"} & set(args):
            self._add_mesh_help()
        namespace, extras = super().parse_known_args(args, namespace)
        for token in extras:
            flag = token.partition("=")[0]
            owners = flag_owners().get(flag) if flag.startswith("--") else None
            if owners:
                kinds = {owner.split()[0] for owner in owners}
                mine = " or ".join(f"{kind} {getattr(chosen, kind[2:])}" for kind in sorted(kinds, reverse=True))
                self.error(f"{flag} is a flag of {' and '.join(owners)}, not of {mine}")
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)} (see labkit train --strategy "
                       f"{chosen.strategy} --optimizer {chosen.optimizer} --help)")
        return namespace, extras

    def _add_owned(self, strategy: str, optimizer: str) -> None:
        if self.chosen == (strategy, optimizer):
            return
        if self.chosen is not None:
            raise RuntimeError("a TrainParser parses one command line; build a new one for another strategy")
        self.chosen = (strategy, optimizer)
        flags = strategy_flags(strategy)
        g = self.add_argument_group(f"strategy {strategy}", None if flags else "no flags of its own")
        owned = {"strategy": add_flags(g, flags), "optim": []}
        if OPTIMIZERS[optimizer]:
            group = _Recording(self.add_argument_group(f"optimizer {optimizer}"))
            add_optimizer_arguments(group, optimizer)
            owned["optim"] = [a.dest for a in group.actions]
        self.set_defaults(func=lambda a: _run(a, owned), owned=owned)

    def _add_mesh_help(self) -> None:
        """Show the device mesh's flags in the help of a plain ``labkit train``: ``--mesh`` works without
        ``--strategy mesh``, so a learner must find it there (help only: parsing still refuses them without it)."""
        g = self.add_argument_group("the device mesh (--mesh alone means --strategy mesh; the other flags here "
                                    "need --mesh)")
        add_flags(g, strategy_flags("mesh"))

    def error(self, message: str):
        """One ``labkit: error: ...`` line and exit code 2, like every other labkit error."""
        flag_error(message)


def flag_owners() -> dict[str, list[str]]:
    """``{"--mp-devices": ["--strategy model-parallel"], "--kfac-damping": ["--optimizer kfac"], ...}``."""
    owners: dict[str, list[str]] = {}
    for name in STRATEGIES:
        for f in strategy_flags(name):
            owners.setdefault(f["flag"], []).append(f"--strategy {name}")
    for name in OPTIMIZERS:
        group = _Recording(argparse.ArgumentParser(add_help=False))
        add_optimizer_arguments(group, name)
        for action in group.actions:
            for flag in action.option_strings:
                owners.setdefault(flag, []).append(f"--optimizer {name}")
    return owners


class _Recording:
    """An argument group that remembers the actions added to it (which flags an optimizer owns)."""

    def __init__(self, group):
        self.group, self.actions = group, []

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        self.actions.append(self.group.add_argument(*args, **kwargs))
        return self.actions[-1]


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model with a parallel strategy", allow_abbrev=False,
                       description="Train a model with a parallel strategy through labkit's one training loop. "
                       "Under torchrun or srun every rank runs this same command. Each --strategy and --optimizer "
                       "brings its own flags: `labkit train --strategy ddp --optimizer kfac --help` lists them.")
    p.__class__ = TrainParser  # argparse's sub-parsers are plain parsers; this one reads --strategy first
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="lenet", help="mlp, lenet, resnet20, resnet32, resnet50, alexnet_small; "
                   "language models for the text datasets: gpt (= gpt-tiny), gpt-tiny, gpt-small, gpt-100m; "
                   "with mixture-of-experts MLPs: gpt-moe (= gpt-moe-tiny), gpt-moe-tiny-top2, gpt-moe-small")
    g.add_argument("--dataset", default="mnist-sample",
                   help="mnist, cifar10, mnist-sample, synthetic-mnist, synthetic-cifar10; text: text-sample "
                        "(offline), tinyshakespeare, tinyshakespeare-bpe")
    g.add_argument("--seq-len", type=_number("seq_len"), default=None,
                   help="tokens per example of a text dataset (the GPT's context); None: 128")
    g.add_argument("--dropout", type=_number("dropout"), default=0.0,
                   help="a GPT's dropout probability (embedding, attention, residual)")
    g.add_argument("--recompute", default="none", choices=RECOMPUTE,
                   help="activation checkpointing: none; full = each block (a GPT's, a ResNet's residual blocks) "
                        "keeps only its input and runs again in backward; selective = a GPT's attention scores only")
    g.add_argument("--data-root", default=None, help=ROOT_HELP)
    g.add_argument("--download", action="store_true", help="download the dataset if missing (needs internet)")
    g.add_argument("--augment", action="store_true", help="random crop + flip (CIFAR10)")
    g.add_argument("--train-size", type=_number("train_size"), default=None,
                   help="use only the first N training samples (None: all)")
    g.add_argument("--test-size", type=_number("test_size"), default=None,
                   help="use only the first N test samples (None: all)")
    g.add_argument("--num-workers", type=_number("num_workers"), default=0,
                   help="DataLoader worker processes (--loader torch)")
    g.add_argument("--loader", default="tensor", choices=("tensor", "torch"),
                   help="tensor: the dataset resident on the training device, batches normalised and augmented "
                        "at once; torch: torchvision's per-sample DataLoader (data too big for memory)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=_number("epochs"), default=None,
                   help="passes over the training set (default: 1; with --steps, as many as those steps take)")
    g.add_argument("--batch-size", type=_number("batch_size"), default=64,
                   help="samples per step on each data-parallel rank")
    g.add_argument("--test-batch-size", type=_number("test_batch_size"), default=512,
                   help="samples per evaluation batch")
    g.add_argument("--optimizer", default=None, choices=list(OPTIMIZERS),
                   help="kfac = K-FAC preconditioning the gradients of --kfac-base; shampoo, soap, muon split their "
                        "matrices over the data-parallel ranks; None: adam for a GPT, else sgd")
    g.add_argument("--base-lr", type=_number("base_lr"), default=None,
                   help="learning rate (before --scale-lr and warm-up); None: the model's, 0.05 (alexnet_small "
                        "0.005; a GPT 0.001 with adam, 0.1 with sgd; an image model 3e-4 with shampoo, 3e-3 with "
                        "soap or muon)")
    g.add_argument("--momentum", type=_number("momentum"), default=0.9, help="SGD/LARS momentum")
    g.add_argument("--weight-decay", type=_number("weight_decay"), default=0.0, help="L2 penalty")
    g.add_argument("--lr-decay", type=_number("lr_decay"), nargs="*", default=[], metavar="EPOCH",
                   help="multiply the LR by --lr-decay-factor at these epochs, e.g. 35 75 90")
    g.add_argument("--lr-decay-factor", type=_number("lr_decay_factor"), default=0.1,
                   help="LR multiplier at each --lr-decay epoch")
    g.add_argument("--warmup-epochs", type=_number("warmup_epochs"), default=0.0,
                   help="linear LR warm-up (Goyal et al.)")
    g.add_argument("--scale-lr", action="store_true", help="linear scaling: LR × number of data-parallel ranks")
    g.add_argument("--max-steps", type=_number("max_steps"), default=None,
                   help="PER EPOCH: stop each epoch after N steps (None: whole epoch)")
    g.add_argument("--steps", type=_number("steps"), default=None,
                   help="IN ALL: train N steps, over as many epochs as they take (the last one cut short); "
                        "instead of --epochs (None: --epochs whole epochs)")
    g.add_argument("--seed", type=_number("seed"), default=0, help="seed of weights, shuffling and augmentation")
    g.add_argument("--amp", default=None, choices=("bf16",),
                   help="mixed precision: forward passes under bfloat16 autocast (CPU and CUDA); None: float32")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic GPU kernels (cuDNN, cuBLAS; slower), so a run and its resumed copy give the "
                        "same weights on a GPU as they do on a CPU")
    g.add_argument("--channels-last", action="store_true",
                   help="NHWC memory layout for conv models and their input batches (faster conv kernels)")
    g = p.add_argument_group("where and how")
    g.add_argument("--strategy", default="single", choices=list(STRATEGIES), help="how the work is split")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--backend", default=None, help="nccl or gloo (None: nccl on GPUs, gloo on CPU)")
    g.add_argument("--timeout-s", type=_number("timeout_s"), default=1800.0,
                   help="collective timeout: a dead rank fails the job")
    g.add_argument("--watchdog", type=within("float", "[0, 1e7]"), default=None, metavar="SECONDS",
                   help="a rank waiting this long in one collective ends the job with a table of where every rank "
                        "is (labkit faults); 0: off (default: $LABKIT_WATCHDOG, else 0)")
    g.add_argument("--out", default=None, help="results folder (None: runs/<model>-<dataset>-<strategy>-<optim>)")
    g.add_argument("--name", default=None, help="run name in the results (None: from the folder)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out if present")
    g.add_argument("--no-checkpoint", dest="checkpoint", action="store_false", help="do not write checkpoints")
    g.add_argument("--profile", action="store_true", help="write a torch.profiler trace to <out>/profile")
    g.add_argument("--log-every", type=_number("log_every"), default=20,
                   help="print an estimated throughput line every N steps")
    g.add_argument("--step-delay-s", type=_number("step_delay_s"), default=0.0, metavar="SECONDS",
                   help="sleep after every step: slow a tiny run down enough to practise pre-emption")


def config_from_args(args: argparse.Namespace, owned: dict[str, list[str]]):
    from labkit.train.config import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    if args.steps is not None and args.epochs is not None:
        raise ConfigError(f"--steps {args.steps} is the whole run's length and --epochs {args.epochs} another: "
                          "give one of them")
    values = {k: v for k, v in vars(args).items() if k in names and not (k == "epochs" and v is None)}
    cfg = TrainConfig(**values)
    cfg.strategy_options = {k: getattr(args, k) for k in owned["strategy"]}
    if cfg.strategy == "mesh":
        _refuse_absent_dimensions_flags(args)
    cfg.optim_options = {k: getattr(args, k) for k in owned["optim"]}
    return cfg


def _refuse_absent_dimensions_flags(args: argparse.Namespace) -> None:
    """A mesh dimension's flag set away from its default on a ``--mesh`` without that dimension would change
    nothing: one line naming the flag and its dimension (``--mesh dp=2 --sequence-parallel`` would train plain dp)."""
    present = ({name for name, size in MeshShape.parse(args.mesh).items() if size > 1}
               if args.mesh is not None else {"dp"})  # no --mesh: dp over every rank
    owners: dict[str, tuple[dict, list[str]]] = {}
    for name in available_dimensions():
        for flag in dimension_flags(name):
            owners.setdefault(flag["flag"], (flag, []))[1].append(name)
    for text, (flag, names) in owners.items():
        dest = flag.get("dest") or text.lstrip("-").replace("-", "_")
        default = flag.get("default", False if flag.get("action") == "store_true" else None)
        if getattr(args, dest, default) != default and not present.intersection(names):
            raise ConfigError(f"{text} is a flag of the {' or '.join(names)} dimension, which --mesh {args.mesh} "
                              f"does not have; add {names[0]}=N (N >= 2) to --mesh, or leave {text} out")


def config_from_argv(argv: list[str]):
    """The :class:`labkit.train.run.TrainConfig` that ``labkit train ARGV`` runs, its flags read and checked as
    on the command line (a bad flag is one ``labkit: error`` line and exit 2)."""
    from labkit.cli import build_parser

    argv = ["train", *map(str, argv)]
    args = build_parser(argv).parse_args(argv)
    return config_from_args(args, args.owned)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _run(args: argparse.Namespace, owned: dict[str, list[str]]) -> int:
    from labkit.faults.watchdog import start_for_training
    from labkit.train.run import run

    cfg = config_from_args(args, owned)
    if cfg.strategy == "ft" and cfg.strategy_options.get("ft_replica") is None:  # the replicas' supervisor
        from labkit.train.ft_supervise import supervise

        supervise(cfg)
        return 0
    gpus = args.device == "cuda" or (args.device == "auto" and _cuda_available())
    start_for_training(args.watchdog, args.timeout_s, args.backend or ("nccl" if gpus else "gloo"))
    run(cfg)
    return 0

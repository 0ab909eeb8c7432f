"""Model parallelism: the split-size sweep (throughput vs micro-batch size), and hybrid vs DDP on 2 ranks.

    labkit bench model-parallel                                      # both parts, devices of this machine
    labkit bench model-parallel --part sweep --batch-size 256 --split-sizes 8 16 32 64 128 256
    labkit bench model-parallel --part hybrid-ddp --ranks 2          # starts torchrun itself

Sweep: one process drives 2 devices (2 GPUs, or the CPU twice: then nothing overlaps and no split size
can win). Contenders, alternated every round: the whole model on one device, the naive split (one
micro-batch), and pipelined inputs with each split size. Hybrid vs DDP: alexnet_small through the
training loop on ``--ranks`` ranks, alternated, global samples/s.
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from labkit.bench.harness import alternate, config_of
from labkit.data import loader as loaders
from labkit.dist.group import DistEnv, print0, seed_everything
from labkit.dist.launch_info import resolve_device
from labkit.strategies.base import Strategy

#: ``labkit bench model-parallel`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--part", "default": "all", "choices": ["all", "sweep", "hybrid-ddp"], "help": "which part to run"},
    {"flag": "--model", "default": "alexnet_small", "help": "labkit model"},
    {"flag": "--dataset", "default": "synthetic-cifar10", "help": "dataset"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 128, "help": "sweep: samples per step"},
    {"flag": "--split-sizes", "type": "int", "range": "[1, inf)", "nargs": "+", "default": [4, 8, 16, 32, 64],
     "metavar": "N",
     "help": "sweep: micro-batch sizes"},
    {"flag": "--mp-devices", "type": "int", "range": "[1, inf)", "default": 2, "help": "sweep: devices (stages)"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 5,
     "help": "timed steps per contender per round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 3,
     "help": "timed rounds (each runs every contender)"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--ranks", "type": "int", "range": "[1, inf)", "default": 2, "help": "hybrid vs DDP: ranks to start"},
    {"flag": "--rank-batch-size", "type": "int", "range": "[1, inf)", "default": 32,
     "help": "hybrid vs DDP: samples per rank per step"},
    {"flag": "--out", "default": "runs/bench-model-parallel", "help": "results folder"},
]


def split_size_sweep(model_name: str = "alexnet_small", dataset: str = "synthetic-cifar10", batch_size: int = 128,
                     split_sizes=(4, 8, 16, 32, 64), stages: int = 2, steps: int = 5, rounds: int = 3,
                     device: str = "auto", writer=None, progress: bool = True) -> dict:
    """Throughput of single device vs naive split vs pipelined inputs with each split size.

    On the CPU the sweep runs on one thread (restored afterwards): one core plays one device, and on a shared
    machine multi-threaded kernels wait for descheduled threads, which turns the numbers into noise.

    Returns:
        ``{"rates": {contender: samples/s}, "timelines": {contender: [BusyInterval dict, ...]},
        "devices": [...]}``; contenders are ``"single"``, ``"naive"`` and ``"split N"``.
    """
    dev = resolve_device(device)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _sweep(model_name, dataset, batch_size, split_sizes, stages, steps, rounds, dev, writer, progress)
    finally:
        torch.set_num_threads(threads)


def _sweep(model_name, dataset, batch_size, split_sizes, stages, steps, rounds, dev, writer, progress) -> dict:
    from labkit.data import datasets as data
    from labkit.models import cnn as models
    from labkit.strategies.model_parallel import ModelParallel
    from labkit.train.loop import fit

    devices = ([torch.device("cuda", i % torch.cuda.device_count()) for i in range(stages)] if dev.type == "cuda"
               else [dev] * stages)
    info = data.dataset_info(dataset)
    x, y = next(iter(loaders.make_loader(data.get_dataset(dataset), batch_size, shuffle=False)))
    seed_everything(0)
    template = models.get_model(model_name, info.num_classes, info.in_channels, info.image_size, sequential=True)
    contenders = {"single": None, "naive": None, **{f"split {s}": s for s in split_sizes}}

    def build(name: str, record: bool = False) -> nn.Module:
        if name == "single":
            return copy.deepcopy(template).to(devices[0])
        return ModelParallel(copy.deepcopy(template), devices, "params", contenders[name], record=record)

    batch = x.to(devices[0]), y.to(devices[-1])

    def contender(name: str):
        model = build(name)
        strategy = _Placed(devices[:1] if name == "single" else devices)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def call() -> int:
            fit(model, [batch] * steps, None, optimizer, epochs=1, strategy=strategy, log_every=10 ** 9,
                printer=lambda line: None)
            return steps * batch_size
        return call

    log = None if writer is None else (lambda r: writer.log({**r, "experiment": "split-size",
                                                               "split_size": contenders[r["contender"]] or batch_size}))
    results = alternate({name: contender(name) for name in contenders}, rounds, devices, log=log, progress=progress)
    rates = {name: results.median(name) for name in contenders}
    timelines = {}
    for name in ("naive", f"split {max(split_sizes, key=lambda s: rates[f'split {s}'])}"):
        model = build(name, record=True)
        for _ in range(2):  # the second step is the one kept: warm
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x.to(devices[0])), y.to(devices[-1])).backward()
        timelines[name] = [asdict(iv) for iv in model.timeline()]
        if writer is not None:
            for iv in timelines[name]:
                writer.log({"kind": "trace", "contender": name, **iv})
    return {"rates": rates, "timelines": timelines, "devices": [str(d) for d in devices], "batch_size": batch_size}


class _Placed(Strategy):
    """fit's view of a module already spread over ``devices`` (the same GPU may repeat): inputs go to the first,
    targets to the last."""

    def __init__(self, devices: list[torch.device]):
        super().__init__(DistEnv(device=devices[0]))
        self._devices = devices

    @property
    def target_device(self) -> torch.device:
        return self._devices[-1]

    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self._devices))


def plot_sweep(result: dict, ax=None):
    """samples/s vs split size, with the single-device and naive-split rates as lines."""
    import matplotlib.pyplot as plt

    from labkit.viz.figcheck import legend_beside

    rates = result["rates"]
    sizes = sorted(int(k.split()[1]) for k in rates if k.startswith("split "))
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(sizes, [rates[f"split {s}"] for s in sizes], marker="o", label="pipelined inputs")
    ax.axhline(rates["single"], color="grey", linestyle="--", label="whole model on one device")
    ax.axhline(rates["naive"], color="tab:red", linestyle=":", label="naive split (no micro-batches)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel(f"split size (samples per micro-batch, batch {result['batch_size']})")
    ax.set_ylabel("samples/s")
    devices = result["devices"]
    ax.set_title(f"split-size sweep: {len(devices)} stages on {', '.join(dict.fromkeys(devices))}", fontsize=10)
    ax.grid(alpha=0.3)
    legend_beside(ax, fontsize=8)  # measured rates: no place inside is free in every run
    return ax


def hybrid_vs_ddp(env: DistEnv, dataset: str = "synthetic-cifar10", batch_size: int = 32, steps: int = 5,
                  rounds: int = 3, writer=None) -> dict[str, float]:
    """Global samples/s of the hybrid strategy and of DDP on this job's ranks (call on every rank)."""
    from labkit.bench.contenders import labkit_fit
    from labkit.data import datasets as data
    from labkit.data.tensor import load_split
    from labkit.models import cnn as models
    from labkit.parallel.ddp import DDPStrategy
    from labkit.strategies.hybrid import HybridStrategy

    info = data.dataset_info(dataset)
    train_set = load_split("tensor", dataset, True, device=env.device)

    def contender(cls):
        seed_everything(0)
        strategy = cls(env, {})
        model = strategy.prepare(models.get_model("alexnet_small", info.num_classes, info.in_channels,
                                                  info.image_size))
        loader = loaders.make_loader(train_set, batch_size, shuffle=True, sampler=strategy.sampler(train_set, True, 0),
                                  drop_last=True)
        return labkit_fit(model, loader, strategy, steps)

    def log(record: dict) -> None:
        if writer is not None:
            writer.log({**record, "experiment": "hybrid-vs-ddp", "world_size": env.world_size})
        print0(f"{record['contender']:>6} | round {record['round'] + 1} | {record['samples_per_sec']:.1f} samples/sec")

    results = alternate({"hybrid": contender(HybridStrategy), "ddp": contender(DDPStrategy)}, rounds, [env.device],
                        log=log)
    return {name: results.median(name) for name in ("hybrid", "ddp")}


def main(args: argparse.Namespace) -> int:
    from labkit.dist.group import distributed
    from labkit.dist.launch_info import launch_info
    from labkit.results import RunWriter

    config = config_of(args)
    if args.part == "hybrid-ddp" and launch_info() is not None:  # one of the ranks torchrun started
        with distributed(args.device) as env:
            writer = RunWriter(args.out, enabled=env.is_main)
            rates = hybrid_vs_ddp(env, args.dataset, args.rank_batch_size, args.steps, args.rounds, writer)
            metrics = {"hybrid_samples_per_sec": rates["hybrid"], "ddp_samples_per_sec": rates["ddp"],
                       "hybrid_over_ddp": rates["hybrid"] / rates["ddp"]}
            writer.finish("bench-hybrid-vs-ddp", "bench", config, metrics, env)
        return 0

    out = Path(args.out)
    writer = RunWriter(out)
    metrics: dict = {}
    if args.part in ("all", "sweep"):
        result = split_size_sweep(args.model, args.dataset, args.batch_size, args.split_sizes, args.mp_devices,
                                  args.steps, args.rounds, args.device, writer, progress=True)
        rates = result["rates"]
        print(f"{'contender':<12} {'samples/s':>10}")
        for name, rate in rates.items():
            print(f"{name:<12} {rate:>10.1f}")
        best = max((k for k in rates if k.startswith("split ")), key=rates.get)
        metrics.update(sweep_samples_per_sec=rates, best_split=best, samples_per_sec=rates[best],
                       best_over_single=rates[best] / rates["single"], sweep_devices=result["devices"])
        _save_plot(result, out / "split_size_sweep.png")
    if args.part in ("all", "hybrid-ddp"):
        from labkit.launch.local import torchrun

        sub = out / "hybrid-ddp"
        run = torchrun(["bench", "model-parallel", "--part", "hybrid-ddp", "--dataset", args.dataset,
                        "--rank-batch-size", str(args.rank_batch_size), "--steps", str(args.steps), "--rounds",
                        str(args.rounds), "--device", args.device, "--out", str(sub)], nproc=args.ranks)
        metrics.update(run.summary["metrics"])
        metrics.setdefault("samples_per_sec", metrics["hybrid_samples_per_sec"])
        print(f"hybrid {metrics['hybrid_samples_per_sec']:.1f} samples/sec | ddp {metrics['ddp_samples_per_sec']:.1f}"
              f" samples/sec | hybrid/ddp = {metrics['hybrid_over_ddp']:.3f} on {args.ranks} ranks")
    writer.finish("bench-model-parallel", "bench", config, metrics, DistEnv(device=resolve_device(args.device)))
    print(f"results written to {out}/summary.json" + (" and split_size_sweep.png" if "best_split" in metrics else ""))
    return 0


def _save_plot(result: dict, path: Path) -> None:
    import matplotlib

    if "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plot_sweep(result)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)

"""SGD vs K-FAC step time (eigen and inverse, updates every 1 and 10 steps), split into K-FAC's phases.

    labkit bench kfac                                         # small CNN (lenet) and ResNet-20, batch 128
    labkit bench kfac --models resnet20 --steps 20 --rounds 3 --threads 2
    labkit bench kfac --approx expand reduce                  # also K-FAC-reduce's cheaper Conv2d factors

Every contender (SGD; K-FAC with each method and update frequency) trains its own copy of the same model,
from the same weights, on the same CIFAR-10-shaped batch (synthetic-cifar10, 3x32x32), through
``labkit.train.loop.fit``. Contenders alternate round by round (:mod:`labkit.bench.harness`, one untimed warm-up
call each); the time per step is the total over all rounds divided by the steps, and ``--steps`` is a multiple of every frequency, so updates are amortised exactly.
K-FAC's extra time is split with ``KFAC.timings`` into *factors* (capturing A and G in the hooks),
*decomposition* (eigh or Cholesky) and *precondition* (applying them, KL clip); the rest is the
forward/backward/SGD step every contender pays. Wall and CPU (process) time are both reported: on a
shared machine the CPU time is the steadier of the two, and on CPU the phases are measured in CPU time. The
*paired* ratio is the median over rounds of a contender's CPU time over SGD's in the same round, run back to
back: a machine whose speed drifts between rounds moves both alike.

Below each model's table, K-FAC's *floor*: what a step cannot do without, before a single factor is collected. The
preconditioning products are counted (:func:`precondition_madds`) and priced at the device's fp32 matmul rate,
measured right after the contenders (:func:`labkit.train.peak.measure_matmul`, the best of five 1024 × 1024 products:
no smaller product runs faster), one decomposition of every layer is timed (:func:`decomposition_seconds`) and
divided by the update frequency. A target under ``1 + floor`` cannot be met
on this machine with these layers, however fast the factors become.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from labkit.bench.harness import alternate, config_of
from labkit.dist.group import DistEnv, seed_everything
from labkit.dist.launch_info import resolve_device
from labkit.errors import ConfigError
from labkit.optim.kfac.preconditioner import KFAC
from labkit.strategies.base import Strategy
from labkit.train.peak import measure_matmul

PHASES = ("factors", "decomposition", "precondition")


#: ``labkit bench kfac`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--models", "nargs": "+", "default": ["lenet", "resnet20"], "help": "labkit models"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 128, "help": "samples per step"},
    {"flag": "--methods", "nargs": "+", "default": ["eigen", "inverse"], "choices": ["eigen", "inverse"],
     "help": "K-FAC inversion methods to time"},
    {"flag": "--freqs", "nargs": "+", "type": "int", "range": "[1, inf)", "default": [1, 10],
     "help": "K-FAC update frequencies"},
    {"flag": "--approx", "nargs": "+", "default": ["expand"], "choices": ["expand", "reduce"],
     "help": "Conv2d factor approximations to time (reduce is K-FAC-reduce)"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 20,
     "help": "steps per contender per round (a multiple of every freq)"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 3,
     "help": "timed rounds (each runs every contender)"},
    {"flag": "--threads", "type": "int", "range": "[1, inf)", "default": None,
     "help": "torch CPU threads (default: torch's choice)"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": "runs/bench-kfac", "help": "results folder"},
]


class Contender:
    """One model copy + SGD (+ K-FAC) that trains ``steps`` steps on a fixed batch per call, through ``fit``.

    The first call is the harness's warm-up (K-FAC's first factors and decompositions); the phase timings
    start after it.
    """

    def __init__(self, name: str, template: nn.Module, device: torch.device, batch: tuple[torch.Tensor, torch.Tensor],
                 steps: int, method: str | None = None, freq: int | None = None, approx: str = "expand"):
        self.name, self.method, self.freq, self.approx = name, method, freq, approx
        self.batch, self.steps, self.calls = batch, steps, 0
        self.model = copy.deepcopy(template).to(device)
        self.strategy = Strategy(DistEnv(device=device))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.kfac = None if method is None else KFAC(self.model, method=method, factor_update_freq=freq,
                                                     approx=approx, optimizer=self.optimizer, timed=True)
        if self.kfac is not None and device.type == "cpu":
            self.kfac.clock = time.process_time  # phases in CPU time, comparable with the cpu ms column

    def __call__(self) -> int:
        from labkit.train.loop import fit

        fit(self.model, [self.batch] * self.steps, None, self.optimizer, epochs=1, strategy=self.strategy,
            preconditioner=self.kfac, log_every=10 ** 9, printer=lambda line: None)
        self.calls += 1
        if self.calls == 1 and self.kfac is not None:
            self.kfac.timings = dict.fromkeys(self.kfac.timings, 0.0)
        return self.steps * len(self.batch[1])


def precondition_madds(layers, method: str) -> int:
    """Multiply-adds of one step's preconditioning products (:func:`labkit.optim.kfac.linalg.precondition_batched`)
    over layers of shape (d_out, d_in): inverse ``G_d⁻¹ ∇W``, then ``· A_d⁻¹``: ``d_out²·d_in + d_out·d_in²`` a
    layer; eigen twice that (``Q_Gᵀ ∇W · Q_A``, then ``Q_G · … · Q_Aᵀ``)."""
    per_layer = sum(l.d_out ** 2 * l.d_in + l.d_out * l.d_in ** 2 for l in layers)
    return 2 * per_layer if method == "eigen" else per_layer


def decomposition_seconds(kfac: KFAC, repeats: int = 3) -> float:
    """One decomposition of every layer of ``kfac`` from its current factors (what a decomposition step adds),
    median of ``repeats``, on ``kfac.clock`` (a GPU synchronised around each). It leaves the same decompositions as
    before."""
    sync = torch.cuda.synchronize if kfac.layers[0].module.weight.is_cuda else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = kfac.clock()
        for layer in kfac.layers:
            layer.decompose(kfac.method.value, kfac.damping)
        sync()
        times.append(kfac.clock() - start)
    return statistics.median(times)


def floor_of(row: dict, kfac: KFAC, peak_flops: float, sgd_ms: float) -> dict:
    """K-FAC's least cost per step (the module docstring): products at ``peak_flops`` + one decomposition ÷ the
    update frequency, in ms and as a multiple of SGD's ``sgd_ms``."""
    madds = precondition_madds(kfac.layers, kfac.method.value)
    products_ms = 1e3 * 2 * madds / peak_flops
    decomposition_ms = 1e3 * decomposition_seconds(kfac)
    floor_ms = products_ms + decomposition_ms / row["update_freq"]
    return {"precondition_madds": madds, "products_at_peak_ms": products_ms, "decomposition_step_ms": decomposition_ms,
            "floor_ms": floor_ms, "floor_ratio": 1 + floor_ms / sgd_ms}


def bench_model(name: str, args: argparse.Namespace, device: torch.device, writer) -> list[dict]:
    """Time every contender on one model; return one row per contender."""
    from labkit.data import datasets as data
    from labkit.models import cnn as models

    info = data.dataset_info("synthetic-cifar10")
    seed_everything(0)
    template = models.get_model(name, num_classes=info.num_classes, in_channels=info.in_channels,
                                image_size=info.image_size)
    dataset = data.get_dataset("synthetic-cifar10", train=True, size=args.batch_size)
    batch = dataset.data.to(device), dataset.targets.to(device)  # (B, 3, 32, 32), (B,)
    contenders = [Contender("sgd", template, device, batch, args.steps)]
    contenders += [Contender(f"{m}/{f}" + ("" if a == "expand" else f" {a}"), template, device, batch, args.steps,
                             m, f, a)
                   for a in getattr(args, "approx", ["expand"]) for m in args.methods for f in args.freqs]
    results = alternate({c.name: c for c in contenders}, args.rounds, [device])
    rows = []
    for c in contenders:
        own = [r for r in results.records if r["contender"] == c.name]
        steps = c.steps * len(own)
        wall, cpu = sum(r["time_s"] for r in own), sum(r["cpu_s"] for r in own)
        timings = c.kfac.timings if c.kfac is not None else dict.fromkeys(PHASES, 0.0)
        rows.append({"kind": "bench", "model": name, "contender": c.name, "method": c.method or "sgd",
                     "approx": c.approx if c.method else None, "update_freq": c.freq, "batch_size": args.batch_size,
                     "steps": steps, "step_ms": 1e3 * wall / steps, "cpu_ms": 1e3 * cpu / steps,
                     **{f"{p}_ms": 1e3 * timings[p] / steps for p in PHASES}})
    peak = measure_matmul(device, torch.float32) if len(contenders) > 1 else None
    for c, row in zip(contenders, rows):
        row["matmul_flops_per_s"] = peak
        row["ratio"], row["cpu_ratio"] = row["step_ms"] / rows[0]["step_ms"], row["cpu_ms"] / rows[0]["cpu_ms"]
        if c.kfac is not None:  # the phases are CPU time on a CPU: so is SGD's step it is set beside
            row.update(floor_of(row, c.kfac, peak, rows[0]["cpu_ms" if device.type == "cpu" else "step_ms"]))
        # each round's CPU time over SGD's in the same round (run back to back): steadier on a drifting machine
        paired = results.cpu_ratios(c.name, "sgd")
        row["cpu_ratio_median"], row["cpu_ratio_min"], row["cpu_ratio_max"] = (statistics.median(paired), min(paired),
                                                                               max(paired))
        writer.log(row)
    return rows


def main(args: argparse.Namespace) -> int:
    from labkit.results import RunWriter

    bad = [f for f in args.freqs if f < 1 or args.steps % f]
    if bad or args.rounds < 1 or args.batch_size < 1:
        raise ConfigError(f"--steps {args.steps} must be a multiple of every --freqs value (got {args.freqs}), "
                          f"--rounds and --batch-size >= 1; e.g. --steps 20 --freqs 1 10")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    writer = RunWriter(args.out)
    print(f"K-FAC step time | batch {args.batch_size} | {args.rounds} rounds x {args.steps} steps | {device}, "
          f"{torch.get_num_threads()} threads | ms per step (CPU ms per step), K-FAC phases in "
          f"{'CPU' if device.type == 'cpu' else 'wall'} ms per step")
    header = f"{'model':<10}{'contender':<18}{'step ms':>10}{'cpu ms':>10}{'x SGD':>8}{'cpu x':>8}" + \
        f"{'paired cpu x (min-max)':>26}" + "".join(f"{p:>15}" for p in PHASES)
    metrics = {}
    for name in args.models:
        rows = bench_model(name, args, device, writer)
        print(header)
        for row in rows:
            paired = f"{row['cpu_ratio_median']:.2f} ({row['cpu_ratio_min']:.2f}-{row['cpu_ratio_max']:.2f})"
            print(f"{row['model']:<10}{row['contender']:<18}{row['step_ms']:>10.1f}{row['cpu_ms']:>10.1f}"
                  f"{row['ratio']:>8.2f}{row['cpu_ratio']:>8.2f}{paired:>26}"
                  + "".join(f"{row[p + '_ms']:>15.1f}" for p in PHASES))
            metrics[f"{name}/{row['contender']}"] = {k: row[k] for k in ("step_ms", "cpu_ms", "ratio", "cpu_ratio",
                                                                          "cpu_ratio_median")}
        if len(rows) > 1:
            print(f"K-FAC's floor on {name}, before any factor: the preconditioning products at this device's fp32 matmul "
                  f"rate ({rows[0]['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s) + one decomposition / frequency")
            for row in rows[1:]:
                print(f"{'':<10}{row['contender']:<18}{row['precondition_madds'] / 1e6:>7.1f} M multiply-adds "
                      f"{row['products_at_peak_ms']:>6.2f} ms + {row['decomposition_step_ms']:.1f} ms / "
                      f"{row['update_freq']} = {row['floor_ms']:.2f} ms: at least {row['floor_ratio']:.2f}x SGD")
    config = config_of(args)
    config["threads"] = torch.get_num_threads()
    writer.finish("bench-kfac", "bench", config, metrics, DistEnv(device=device))
    print(f"results written to {args.out}/summary.json")
    return 0

"""SGD vs K-FAC step time (eigen and inverse, updates every 1 and 10 steps), split into K-FAC's phases.

    labkit bench kfac                                         # small CNN (lenet) and ResNet-20, batch 128
    labkit bench kfac --models resnet20 --steps 20 --rounds 3 --threads 2
    labkit bench kfac --approx expand reduce                  # also K-FAC-reduce's cheaper Conv2d factors

Every contender (SGD; K-FAC with each method and update frequency) trains its own copy of the same model,
from the same weights, on the same CIFAR-10-shaped batch (synthetic-cifar10, 3x32x32). Contenders alternate
within each round so machine noise hits them alike; the time per step is the total over all rounds
divided by the steps, and ``--steps`` is a multiple of every frequency, so updates are amortised exactly.
K-FAC's extra time is split with ``KFAC.timings`` into *factors* (capturing A and G in the hooks),
*decomposition* (eigh or Cholesky) and *precondition* (applying them, KL clip); the rest is the
forward/backward/SGD step every contender pays. Wall and CPU (process) time are both reported: on a
shared machine the CPU time is the steadier of the two, and on CPU the phases are measured in CPU time.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from labkit.dist import DistEnv, resolve_device, seed_everything
from labkit.errors import ConfigError
from labkit.optim.kfac import KFAC

PHASES = ("factors", "decomposition", "precondition")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["lenet", "resnet20"], help="labkit models (default lenet resnet20)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--methods", nargs="+", default=["eigen", "inverse"], choices=["eigen", "inverse"])
    p.add_argument("--freqs", nargs="+", type=int, default=[1, 10], help="K-FAC update frequencies (default 1 10)")
    p.add_argument("--approx", nargs="+", default=["expand"], choices=["expand", "reduce"],
                   help="Conv2d factor approximations to time (default expand; reduce is K-FAC-reduce)")
    p.add_argument("--steps", type=int, default=20, help="steps per contender per round (a multiple of every freq)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="runs/bench-kfac")


class Contender:
    """One model copy + SGD (+ K-FAC) that runs ``steps`` training steps on a fixed batch."""

    def __init__(self, name: str, template: nn.Module, device: torch.device, method: str | None = None,
                 freq: int | None = None, approx: str = "expand"):
        self.name, self.method, self.freq, self.approx = name, method, freq, approx
        self.model = copy.deepcopy(template).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.kfac = None if method is None else KFAC(self.model, method=method, factor_update_freq=freq,
                                                     approx=approx, optimizer=self.optimizer, timed=True)
        if self.kfac is not None and device.type == "cpu":
            self.kfac.clock = time.process_time  # phases in CPU time, comparable with the cpu ms column
        self.wall = self.cpu = 0.0
        self.steps = 0

    def run(self, x: torch.Tensor, y: torch.Tensor, steps: int, record: bool = True) -> None:
        criterion = nn.CrossEntropyLoss()
        _sync(x.device)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.optimizer.zero_grad(set_to_none=True)
            criterion(self.model(x), y).backward()
            if self.kfac is not None:
                self.kfac.step()
            self.optimizer.step()
        _sync(x.device)
        if record:
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu
            self.steps += steps

    def reset_timings(self) -> None:
        if self.kfac is not None:
            self.kfac.timings = dict.fromkeys(self.kfac.timings, 0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name: str, args: argparse.Namespace, device: torch.device, writer) -> list[dict]:
    """Time every contender on one model; return one row per contender."""
    from labkit import data, models

    info = data.dataset_info("synthetic-cifar10")
    seed_everything(0)
    template = models.get_model(name, num_classes=info.num_classes, in_channels=info.in_channels,
                                image_size=info.image_size)
    dataset = data.get_dataset("synthetic-cifar10", train=True, size=args.batch_size)
    x = torch.stack([dataset[i][0] for i in range(args.batch_size)]).to(device)  # (B, 3, 32, 32)
    y = torch.tensor([dataset[i][1] for i in range(args.batch_size)]).to(device)  # (B,)
    contenders = [Contender("sgd", template, device)]
    contenders += [Contender(f"{m}/{f}" + ("" if a == "expand" else f" {a}"), template, device, m, f, a)
                   for a in getattr(args, "approx", ["expand"]) for m in args.methods for f in args.freqs]
    for c in contenders:  # warm-up: allocator, first-call overheads, K-FAC's first factors
        c.run(x, y, max(args.freqs), record=False)
        c.reset_timings()
    for r in range(args.rounds):
        for c in (contenders if r % 2 == 0 else contenders[::-1]):
            c.run(x, y, args.steps)
    base = contenders[0]
    rows = []
    for c in contenders:
        timings = c.kfac.timings if c.kfac is not None else dict.fromkeys(PHASES, 0.0)
        row = {"kind": "bench", "model": name, "contender": c.name, "method": c.method or "sgd",
               "approx": c.approx if c.method else None, "update_freq": c.freq, "batch_size": args.batch_size,
               "steps": c.steps,
               "step_ms": 1e3 * c.wall / c.steps, "cpu_ms": 1e3 * c.cpu / c.steps,
               "ratio": (c.wall / c.steps) / (base.wall / base.steps),
               "cpu_ratio": (c.cpu / c.steps) / (base.cpu / base.steps),
               **{f"{p}_ms": 1e3 * timings[p] / c.steps for p in PHASES}}
        rows.append(row)
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
        "".join(f"{p:>15}" for p in PHASES)
    metrics = {}
    for name in args.models:
        rows = bench_model(name, args, device, writer)
        print(header)
        for row in rows:
            print(f"{row['model']:<10}{row['contender']:<18}{row['step_ms']:>10.1f}{row['cpu_ms']:>10.1f}"
                  f"{row['ratio']:>8.2f}{row['cpu_ratio']:>8.2f}" + "".join(f"{row[p + '_ms']:>15.1f}" for p in PHASES))
            metrics[f"{name}/{row['contender']}"] = {k: row[k] for k in ("step_ms", "cpu_ms", "ratio", "cpu_ratio")}
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["threads"] = torch.get_num_threads()
    writer.finish("bench-kfac", "bench", config, metrics, DistEnv(device=device))
    print(f"results written to {args.out}/summary.json")
    return 0

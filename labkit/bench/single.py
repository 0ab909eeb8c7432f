"""labkit's training loop vs a minimal plain-PyTorch loop, same model, data and batch, one process.

    labkit bench single --model lenet --dataset mnist-sample --batch-size 64 --steps 40 --rounds 6

The two contenders alternate (labkit, plain, labkit, plain, ...) so machine noise hits both alike;
samples/s is summed over rounds and the ratio labkit / plain is reported (target >= 0.97).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from labkit.dist import DistEnv, resolve_device, seed_everything


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="lenet")
    p.add_argument("--dataset", default="mnist-sample")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per contender per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="runs/bench-single")


def plain_steps(model: nn.Module, loader, optimizer, device: torch.device, steps: int) -> int:
    """The textbook loop: move, zero, forward, loss, backward, step. Returns samples processed."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    seen = 0
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        seen += len(x)
    return seen


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(args: argparse.Namespace) -> int:
    from labkit import data, models
    from labkit.results import RunWriter
    from labkit.strategies import Strategy
    from labkit.train import fit

    device = resolve_device(args.device)
    info = data.dataset_info(args.dataset)
    train_set = data.get_dataset(args.dataset, train=True)
    loader = data.make_loader(train_set, args.batch_size, shuffle=True, seed=0, drop_last=True)
    strategy = Strategy(DistEnv(device=device))
    seed_everything(0)
    template = models.get_model(args.model, num_classes=info.num_classes, in_channels=info.in_channels,
                                image_size=info.image_size)

    def contender(name: str) -> tuple[int, float]:
        model = models.get_model(args.model, num_classes=info.num_classes, in_channels=info.in_channels,
                                 image_size=info.image_size).to(device)
        model.load_state_dict(template.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        _sync(device)
        start = time.perf_counter()
        if name == "labkit":
            fit(model, loader, None, optimizer, epochs=1, strategy=strategy, max_steps=args.steps,
                log_every=10 ** 9, printer=lambda line: None)
            seen = args.steps * args.batch_size
        else:
            seen = plain_steps(model, loader, optimizer, device, args.steps)
        _sync(device)
        return seen, time.perf_counter() - start

    contender("plain")  # warm-up: first-call overheads (allocator, kernels) are excluded from both
    contender("labkit")
    writer = RunWriter(args.out)
    times, samples = {"labkit": 0.0, "plain": 0.0}, {"labkit": 0, "plain": 0}
    for r in range(args.rounds):
        for name in (("labkit", "plain") if r % 2 == 0 else ("plain", "labkit")):
            seen, elapsed = contender(name)
            times[name] += elapsed
            samples[name] += seen
            writer.log({"kind": "bench", "contender": name, "round": r, "samples": seen, "time_s": elapsed,
                        "samples_per_sec": seen / elapsed})
    rates = {k: samples[k] / times[k] for k in times}
    ratio = rates["labkit"] / rates["plain"]
    print(f"{'contender':<10} {'samples/s':>12}\n{'labkit':<10} {rates['labkit']:>12.1f}\n"
          f"{'plain':<10} {rates['plain']:>12.1f}\nratio labkit/plain = {ratio:.3f} (target >= 0.97)")
    writer.finish("bench-single", "bench", {k: v for k, v in vars(args).items() if k != "func"},
                  {"labkit_samples_per_sec": rates["labkit"], "plain_samples_per_sec": rates["plain"],
                   "ratio": ratio}, DistEnv(device=device))
    print(f"results written to {args.out}/summary.json")
    return 0

"""The level a profile's layer times are scaled to: ``labkit train``'s own step (:func:`labkit.train.train_step`,
its scheduler and metric sums included) timed back to back at two batch sizes in one process alone, with the
loop's own costs beside it (data loading per sample, the optimizer step per parameter byte); and
:func:`together`, how much slower each of as many processes as fill the cores (:func:`copies`) steps when they
all step at once. :mod:`labkit.advisor.profile` explains how they fit together.
"""
from __future__ import annotations

import math
import os
import statistics

import torch
from torch import nn

from labkit import data as kdata
from labkit.advisor.measure import timed

WINDOW_S = 0.05      # the shortest timed window of back-to-back steps
WINDOWS = 9          # timed windows (or paired rounds) behind each level and κ


def loop_step(model: nn.Module, batches):
    """``(step, optimizer)``: one step of ``labkit train``'s loop on the next of ``batches``: forward, loss,
    backward, SGD with momentum, the learning-rate scheduler and the metric sums (:func:`labkit.train.train_step`)."""
    from labkit.train import lr_factor, single_strategy, train_step

    opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 1000, [], 0.1, 0.0, 1.0))
    strategy, totals, criterion = single_strategy(model), torch.zeros(3, dtype=torch.float64), nn.CrossEntropyLoss()

    def step():
        x, y = next(batches)
        train_step(model, x, y, opt, strategy, criterion, totals, scheduler=scheduler)
    return step, opt


def loop_costs(model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int, windows: int = WINDOWS,
               window_s: float = WINDOW_S) -> tuple[float, float, list[float]]:
    """(s per sample of data loading, s per parameter byte of SGD, s per training step at each size).

    A step is :func:`loop_step` on the next batch from ``labkit train``'s default loader (resident tensors); its
    level is the lower quartile of ``windows`` windows of at least ``window_s``: other programs only ever slow a
    window down (a median of 5 once caught a slow spell of the machine: LeNet 2x).
    """
    from labkit.tensor_data import load_split

    train_set = load_split("tensor", dataset, train=True)
    data, steps, opt = 0.0, [], None
    for b in sizes:
        batches = endless(kdata.make_loader(train_set, b, shuffle=True, drop_last=True))
        data = timed(lambda: next(batches), repeats, window_s=window_s) / b
        step, opt = loop_step(model, batches)
        step()  # warm-up: allocations
        timed(step, 2, window_s=window_s)  # and the thread pool and caches: a process's first windows run slower
        steps.append(timed(step, windows, 0.25, window_s))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    update = timed(opt.step, repeats, window_s=window_s) / max(1, param_bytes)
    return data, update, steps


def copies(threads: int) -> int:
    """Processes that step at once when each has ``threads`` threads and together they fill the cores, as the
    plans priced with a profile at ``threads`` run: one for two threads on two cores, two for one thread."""
    return max(1, (os.cpu_count() or 1) // max(1, threads))


def _together_rank(env, model: nn.Sequential, dataset: str, batch: int, rounds: int, threads: int,
                   window_s: float) -> float:
    import torch.distributed as dist

    from labkit.tensor_data import load_split

    torch.set_num_threads(threads)
    batches = endless(kdata.make_loader(load_split("tensor", dataset, train=True), batch, shuffle=True,
                                        drop_last=True))
    step, _ = loop_step(model, batches)

    def synced():  # a step of a plan of several processes ends when the last of them is done
        step()
        dist.barrier()

    step()
    slowest = torch.tensor([timed(step, 2, window_s=window_s)])  # and the thread pool and caches warm
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    calls = max(1, math.ceil(window_s / max(slowest.item(), 1e-6)))  # the same on every rank
    ratios = []
    for _ in range(rounds):
        alone = 0.0
        for turn in range(env.world_size):  # each rank alone, the others asleep in its barriers
            if env.rank == turn:
                alone = timed(synced, 1, calls=calls)
            else:
                timed(dist.barrier, 1, calls=calls)
        ratios.append(timed(synced, 1, calls=calls) / alone)  # then all at once
    return statistics.median(ratios)


def together(model: nn.Sequential, dataset: str, batch: int, rounds: int, processes: int,
             window_s: float = WINDOW_S) -> float:
    """``κ``, what ``processes`` processes pay for computing at once, measured in as many spawned ranks at this
    process's threads (one process: 1), the mean over the ranks: how much slower each process steps ``model``
    on ``batch`` samples (:func:`loop_step` on its own copy, then a barrier: a step of several processes ends when
    the slowest is done) when they all step at once than when each steps alone. ``rounds`` rounds of one window
    per rank alone (the others asleep in its barriers) and one window of all at once, the same number of steps
    in each; each rank's ratio is paired within its round, so a slow spell of the machine falls on both; the
    median ratio, at least 1 (1: the cores are free and nothing is shared; 2: the processes share what one would
    get, as under a busy machine's fair share per session). A property of the machine, not of a strategy: every
    plan of several processes pays it on its compute (:func:`labkit.advisor.alphabeta.compute_scale`)."""
    if processes <= 1:
        return 1.0
    from labkit.testing import run_ranks

    runs = run_ranks(_together_rank, processes, model, dataset, batch, rounds, torch.get_num_threads(), window_s,
                     timeout=600)
    return max(1.0, statistics.fmean(runs))


def endless(loader):
    """Batches of ``loader`` without end (epoch after epoch)."""
    while True:
        yield from loader

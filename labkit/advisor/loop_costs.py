"""The level a profile's layer times are scaled to: the bare training step timed back to back at two batch
sizes, with the loop's own costs beside it (data loading per sample, the optimizer step per parameter byte,
and ``labkit train``'s bookkeeping per step), in as many processes at once as fill the cores
(:func:`copies`). :mod:`labkit.advisor.profile` explains how the two fit together.
"""
from __future__ import annotations

import os
import statistics

import torch
from torch import nn

from labkit import data as kdata
from labkit.advisor.measure import timed

WINDOW_S = 0.05      # the shortest timed window of back-to-back steps


def loop_costs(model: nn.Sequential, dataset: str, sizes: tuple[int, int],
                repeats: int) -> tuple[float, float, list[float], float]:
    """(s per sample of data loading, s per parameter byte of SGD, s per bare training step at each size,
    s of the training loop's bookkeeping per step).

    The bare step is the next batch from ``labkit train``'s default loader (resident tensors), forward, loss,
    backward, optimizer step, back to back. The loop's step is :func:`labkit.train.train_step` itself (with the
    learning-rate scheduler ``labkit train`` steps, the metric sums, and the meter's update): windows of each
    alternate, and the bookkeeping is the median of the pairs' differences, the mean over both sizes.
    """
    from labkit.meters import ThroughputMeter
    from labkit.tensor_data import load_split
    from labkit.train import lr_factor, single_strategy, train_step

    train_set = load_split("tensor", dataset, train=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 1000, [], 0.1, 0.0, 1.0))
    strategy, totals = single_strategy(model), torch.zeros(3, dtype=torch.float64)
    meter = ThroughputMeter(1, 1, 2**62, every=1000, printer=lambda line: None)
    criterion = nn.CrossEntropyLoss()
    data, steps, books = 0.0, [], []
    for b in sizes:
        batches = endless(kdata.make_loader(train_set, b, shuffle=True, drop_last=True))
        data = timed(lambda: next(batches), repeats, window_s=WINDOW_S) / b

        def step():
            x, y = next(batches)
            opt.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            opt.step()

        def loop_step():
            x, y = next(batches)
            train_step(model, x, y, opt, strategy, criterion, totals, scheduler=scheduler)
            meter.update(len(x))

        for fn in (step, loop_step):
            fn()  # warm-up: allocations
            timed(fn, 2, window_s=WINDOW_S)  # and the thread pool and caches: a process's first windows run up to 1.4x slower
        bare, extra = [], []
        for _ in range(max(9, repeats)):
            bare.append(timed(step, 1, window_s=WINDOW_S))
            extra.append(timed(loop_step, 1, window_s=WINDOW_S) - bare[-1])
        # the lower quartile of 9 or more windows: other programs only ever slow a window down, and this
        # level sets every layer's time (a median of 5 once caught a slow spell of the machine: lenet 2x)
        steps.append(sorted(bare)[round(0.25 * (len(bare) - 1))])
        books.append(statistics.median(extra))
    update = timed(opt.step, repeats, window_s=WINDOW_S) / max(1, sum(p.numel() * p.element_size() for p in model.parameters()))
    return data, update, steps, max(0.0, statistics.fmean(books))


def copies(threads: int) -> int:
    """Processes that step at once when each has ``threads`` threads and together they fill the cores, as the
    plans priced with a profile at ``threads`` run: one for two threads on two cores, two for one thread."""
    return max(1, (os.cpu_count() or 1) // max(1, threads))


def _loop_costs_rank(env, model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int, threads: int):
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.barrier()  # every copy starts its windows together
    return loop_costs(model, dataset, sizes, repeats)


def loop_costs_together(model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int,
                        processes: int) -> tuple[float, float, list[float], float]:
    """:func:`loop_costs` in ``processes`` processes at once, each on its own copy of ``model`` at this process's
    thread count; each number the mean over the copies (one copy: timed here)."""
    if processes <= 1:
        return loop_costs(model, dataset, sizes, repeats)
    from labkit.testing import run_ranks

    runs = run_ranks(_loop_costs_rank, processes, model, dataset, sizes, repeats, torch.get_num_threads(), timeout=600)
    return (statistics.fmean(r[0] for r in runs), statistics.fmean(r[1] for r in runs),
            [statistics.fmean(r[2][k] for r in runs) for k in range(len(sizes))], statistics.fmean(r[3] for r in runs))


def endless(loader):
    """Batches of ``loader`` without end (epoch after epoch)."""
    while True:
        yield from loader

"""The level a profile's layer times are scaled to: the bare training step timed back to back at two batch
sizes in one process alone, with the loop's own costs beside it (data loading per sample, the optimizer step
per parameter byte, and ``labkit train``'s bookkeeping per step); and :func:`together`, how much slower each
of as many processes as fill the cores (:func:`copies`) steps when they all step at once, and FSDP2's own work
per unit; and torchgpipe's own work per micro-batch and partition (:func:`gpipe_task_time`).
:mod:`labkit.advisor.profile` explains how they fit together.
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
WINDOWS = 9          # timed windows (or paired rounds) behind each level, κ, h_f and h_g


def tiny() -> nn.Sequential:
    """Two Linears of 16 features: a model with almost nothing to compute, whose step is all a wrapper's own work."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))


def sgd_step(model: nn.Module, batch, before=None, after=None):
    """``(step, optimizer)``: the bare training step on ``batch()``'s ``(x, y)``: forward, loss, backward, SGD with
    momentum (``before()`` and ``after()`` around forward and backward, where given)."""
    opt, criterion = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9), nn.CrossEntropyLoss()

    def step():
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        if before:
            before()
        criterion(model(x), y).backward()
        if after:
            after()
        opt.step()
    return step, opt


def loop_costs(model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int, windows: int = WINDOWS,
               window_s: float = WINDOW_S) -> tuple[float, float, list[float], float]:
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
    step, opt = sgd_step(model, lambda: next(batches))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 1000, [], 0.1, 0.0, 1.0))
    strategy, totals = single_strategy(model), torch.zeros(3, dtype=torch.float64)
    meter = ThroughputMeter(1, 1, 2**62, every=1000, printer=lambda line: None)
    criterion = nn.CrossEntropyLoss()
    data, steps, books = 0.0, [], []
    for b in sizes:
        batches = endless(kdata.make_loader(train_set, b, shuffle=True, drop_last=True))
        data = timed(lambda: next(batches), repeats, window_s=window_s) / b

        def loop_step():
            x, y = next(batches)
            train_step(model, x, y, opt, strategy, criterion, totals, scheduler=scheduler)
            meter.update(len(x))

        for fn in (step, loop_step):
            fn()  # warm-up: allocations
            timed(fn, 2, window_s=window_s)  # and the thread pool and caches: a process's first windows run up to 1.4x slower
        bare, extra = [], []
        for _ in range(windows):
            bare.append(timed(step, 1, window_s=window_s))
            extra.append(timed(loop_step, 1, window_s=window_s) - bare[-1])
        # the lower quartile of the windows (9 by default): other programs only ever slow a window down, and this
        # level sets every layer's time (a median of 5 once caught a slow spell of the machine: lenet 2x)
        steps.append(sorted(bare)[round(0.25 * (len(bare) - 1))])
        books.append(statistics.median(extra))
    update = timed(opt.step, repeats, window_s=window_s) / max(1, sum(p.numel() * p.element_size() for p in model.parameters()))
    return data, update, steps, max(0.0, statistics.fmean(books))


def copies(threads: int) -> int:
    """Processes that step at once when each has ``threads`` threads and together they fill the cores, as the
    plans priced with a profile at ``threads`` run: one for two threads on two cores, two for one thread."""
    return max(1, (os.cpu_count() or 1) // max(1, threads))


FSDP_UNITS, FSDP_STEPS = 2, 10


def _fsdp_unit_time(env, rounds: int) -> float:
    """``h_f`` on this rank: FSDP2's own seconds per unit and step beyond its collectives (see :func:`together`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    p, x, y = env.world_size, torch.randn(64, 16), torch.randint(0, 10, (64,))
    sharded, plain = tiny(), tiny()
    mesh = init_device_mesh("cpu", (p,))
    for unit in (sharded[0], sharded[2], sharded):
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    sizes = [-(-sum(q.numel() for q in unit.parameters()) // p) * p for unit in (plain[0], plain[2])]
    flats, shards = [torch.zeros(n) for n in sizes], [torch.zeros(n // p) for n in sizes]
    fsdp_step, _ = sgd_step(sharded, lambda: (x, y))
    hand_step, _ = sgd_step(plain, lambda: (x, y), lambda: [dist.all_gather_single(f, s) for f, s in zip(flats, shards)],
                            lambda: [dist.reduce_scatter_single(s, f) for f, s in zip(flats, shards)])

    def fsdp():  # a fixed count: every rank makes the same collectives
        for _ in range(FSDP_STEPS):
            fsdp_step()

    def hand():
        for _ in range(FSDP_STEPS):
            hand_step()

    extra = []
    for _ in range(rounds):
        dist.barrier()
        t_fsdp = timed(fsdp, 1)
        dist.barrier()
        extra.append((t_fsdp - timed(hand, 1)) / (FSDP_STEPS * FSDP_UNITS))
    return max(0.0, statistics.median(extra))


def _together_rank(env, model: nn.Sequential, dataset: str, batch: int, rounds: int, threads: int,
                   window_s: float) -> tuple[float, float]:
    import torch.distributed as dist

    from labkit.tensor_data import load_split

    torch.set_num_threads(threads)
    batches = endless(kdata.make_loader(load_split("tensor", dataset, train=True), batch, shuffle=True,
                                        drop_last=True))
    step, _ = sgd_step(model, lambda: next(batches))

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
    return statistics.median(ratios), _fsdp_unit_time(env, rounds)


def together(model: nn.Sequential, dataset: str, batch: int, rounds: int, processes: int,
             window_s: float = WINDOW_S) -> tuple[float, float]:
    """``(κ, h_f)``, what ``processes`` processes pay for running at once, measured in as many spawned ranks at
    this process's threads (one process: ``(1, 0)``); each number the mean over the ranks.

    ``κ``: how much slower each process steps ``model`` on ``batch`` samples (the bare step, each on its own
    copy, then a barrier: a step of several processes ends when the slowest is done) when they all step at once
    than when each steps alone, what every plan of several processes pays on its compute
    (:func:`labkit.advisor.alphabeta.compute_scale`). ``rounds`` rounds of one window per rank alone (the others
    asleep in its barriers) and one window of all at once, the same number of steps in each; each rank's ratio
    of the two is paired within its round, so a slow spell of the machine falls on both; the median ratio, at
    least 1 (1: the cores are free and nothing is shared; 2: the processes share what one would get, as under a
    busy machine's fair share per session; more: the others' programs also hold one process up while the other
    waits for it).

    ``h_f``: FSDP2's own work per unit and step (its hooks, the copies into and out of the flat buffers, the
    optimizer's step over DTensors), beyond the collectives it makes: on a model with almost nothing to compute
    (two Linears, 64 samples), ``h_f = (T_fsdp − T_hand) / (2 units)`` with ``T_hand`` the same step unsharded
    making the same collectives by hand (an all-gather per unit before forward, a reduce-scatter after
    backward), paired windows of 10 steps, the median of ``rounds``."""
    if processes <= 1:
        return 1.0, 0.0
    from labkit.testing import run_ranks

    runs = run_ranks(_together_rank, processes, model, dataset, batch, rounds, torch.get_num_threads(), window_s,
                     timeout=600)
    return max(1.0, statistics.fmean(r[0] for r in runs)), statistics.fmean(r[1] for r in runs)


GPIPE_PARTITIONS, GPIPE_MICROBATCHES = 2, 4


def gpipe_task_time(windows: int = WINDOWS, window_s: float = WINDOW_S) -> float:
    """``h_g`` (:class:`labkit.advisor.plan.Profile`): torchgpipe's seconds per micro-batch and partition at this
    process's threads, ``(T_gpipe − T_plain) / (m·k)`` on :func:`tiny`, the lower quartiles of ``windows``."""
    from labkit.strategies.gpipe import make_gpipe

    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))

    def step_time(model: nn.Module) -> float:
        step, _ = sgd_step(model, lambda: (x, y))
        step()
        timed(step, 2, window_s=window_s)
        return timed(step, windows, 0.25, window_s)

    k, m = GPIPE_PARTITIONS, GPIPE_MICROBATCHES
    pipe = make_gpipe(tiny(), ["cpu"] * k, m, "except_last", [2, 1])
    return max(0.0, step_time(pipe) - step_time(tiny())) / (m * k)


def endless(loader):
    """Batches of ``loader`` without end (epoch after epoch)."""
    while True:
        yield from loader

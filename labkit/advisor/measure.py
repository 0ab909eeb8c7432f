"""The advisor's measurements, each cached as a run, every time taken with :func:`timed`: this machine's links
(:func:`measure_link`) and the model's profile (:func:`load_or_measure`): per layer ``i`` of the flat
``nn.Sequential`` its bytes and times at two batch sizes fitted to lines (the shape, layers timed alone), the level
from the training loop's own step (:func:`loop_costs`) and κ, the slowdown of processes computing at once
(:func:`_together_rank`):

    fwd_i(b) = fwd0_i + fwd1_i · b          bwd_i(b) = bwd0_i + bwd1_i · b
    scale(b) = (step(b) − u·P − d·b) / Σ_i (fwd_i + bwd_i)(b)      κ = step of each of n at once / its step alone
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
from dataclasses import asdict
from itertools import chain, repeat
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn

from labkit.advisor.plan import LayerProfile, Profile, profile_from_dict
from labkit.advisor.topology import KINDS, Topology, ring_counts
from labkit.collectives.cost import CostModel, fit_alpha_beta
from labkit.data import datasets as kdata
from labkit.data import loader as loaders
from labkit.data.tensor import load_split
from labkit.dist import group as kdist
from labkit.dist.testing import run_ranks
from labkit.models import cnn as kmodels
from labkit.parallel.tp import linear_pairs
from labkit.results import RunWriter, load_run
from labkit.strategies.balance import estimate_layer_memory
from labkit.train.loop import lr_factor, single_strategy, train_step
from labkit.train.meters import process_memory_gb

CACHE = Path("runs") / "advisor"
FORMAT = 9  # the profile's; other formats are measured again
WINDOWS, WINDOW_S = 9, 0.05  # timed windows of at least WINDOW_S s behind each level and κ
FIT_SIZES = [4, 16 << 10, 256 << 10, 1 << 20]  # bytes: latency-bound to bandwidth-bound
CALLS, FIT_WINDOWS, WORK_S = 5, 5, 0.01  # calls per window, windows per size and kind, computing before each call


def timed(fn, windows: int, quantile: float = 0.5, window_s: float = 0.0, setup=None, calls: int = 0) -> float:
    """Seconds per call of ``fn``: the ``quantile`` (0.5 the median, 0 the fastest) of ``windows`` windows of
    ``calls`` back-to-back calls (0: as many as fill ``window_s``, counted by one untimed call). ``setup()``,
    untimed, runs before each window; ``fn`` gets what it returns."""
    def window(n: int) -> float:
        state = setup() if setup else None
        start = perf_counter()
        for _ in range(n):
            fn(state) if setup else fn()
        return (perf_counter() - start) / n

    calls = calls or max(1, math.ceil(window_s / max(window(1), 1e-6)))
    return sorted(window(calls) for _ in range(windows))[round(quantile * (windows - 1))]


def _batches(train_set, b: int):
    """``labkit train``'s default loader (resident tensors) of ``b`` samples, epoch after epoch."""
    return chain.from_iterable(repeat(loaders.make_loader(train_set, b, shuffle=True, drop_last=True)))


def _layer_times(model: nn.Sequential, x: torch.Tensor, repeats: int) -> list[tuple[float, float, int]]:
    """(forward s, backward s, output bytes per sample) per layer on ``x``, the times medians of ``repeats``; inputs
    need a gradient but the data (a first layer without parameters, e.g. a ``Flatten``, has no backward)."""
    out = []
    for i, layer in enumerate(model):
        inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        forward = timed(lambda: layer(inp), repeats)
        x = layer(inp)  # the next layer's input
        grad = torch.randn_like(x)
        backward = timed(lambda y: y.backward(grad), repeats, setup=lambda: layer(inp)) if x.requires_grad else 0.0
        out.append((forward, backward, x[0].numel() * x.element_size()))
    return out


def loop_step(model: nn.Module, batches, window_s: float):
    """``(step, optimizer, s)``: one :func:`labkit.train.loop.train_step` (SGD with momentum) on the next of ``batches``,
    warmed up by a step (allocations) and two windows of ``window_s`` (first windows run slower), ``s`` the faster."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 1000, [], 0.1, 0.0, 1.0))
    strategy, totals, criterion = single_strategy(model), torch.zeros(3, dtype=torch.float64), nn.CrossEntropyLoss()

    def step():
        train_step(model, *next(batches), opt, strategy, criterion, totals, scheduler=scheduler)
    step()
    return step, opt, timed(step, 2, window_s=window_s)


def loop_costs(model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int, windows: int = WINDOWS,
               window_s: float = WINDOW_S) -> tuple[float, float, list[float]]:
    """``(d, u, [step(b) for b in sizes])``: ``step(b)`` the lower quartile of ``windows`` windows of
    :func:`loop_step`."""
    train_set = load_split("tensor", dataset, train=True)
    steps = []
    for b in sizes:
        batches = _batches(train_set, b)
        data = timed(lambda: next(batches), repeats, window_s=window_s) / b
        step, opt, _ = loop_step(model, batches, window_s)
        steps.append(timed(step, windows, 0.25, window_s))
    update = timed(opt.step, repeats, window_s=window_s) / max(1, sum(p.nbytes for p in model.parameters()))
    return data, update, steps


def copies(threads: int) -> int:
    """``n = cores // threads`` (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, threads))


def _together_rank(env, model: nn.Module, dataset: str, b: int, rounds: int, threads: int, window_s: float) -> float:
    """This rank's κ: the median over ``rounds`` rounds of its step (:func:`loop_step`) all at once ÷ alone."""
    torch.set_num_threads(threads)
    step, _, warm = loop_step(model, _batches(load_split("tensor", dataset, train=True), b), window_s)
    slowest = kdist.all_reduce(torch.tensor([warm]), op=dist.ReduceOp.MAX).item()
    calls = max(1, math.ceil(window_s / max(slowest, 1e-6)))  # the same on every rank

    def synced():  # a step of a plan of several processes ends when the last of them is done
        step()
        dist.barrier()

    ratios = []
    for _ in range(rounds):  # each rank alone in turn (the others asleep in its barriers), then all at once
        alone = [timed(synced if turn == env.rank else dist.barrier, 1, calls=calls) for turn in range(env.world_size)]
        ratios.append(timed(synced, 1, calls=calls) / alone[env.rank])
    return statistics.median(ratios)


def _cache(model: str, dataset: str, batch_size: int, threads: int, root: Path | str) -> tuple[Path, dict]:
    """(folder, key): where a profile is cached and what it must have been measured with to be reused."""
    return Path(root) / f"profile-{model}-{dataset}-b{batch_size}-t{threads}", {
        "format": FORMAT, "model": model, "dataset": dataset, "batch_size": batch_size, "threads": threads,
        "torch": torch.__version__, "host": os.uname().nodename}


def load_or_measure(model: str, dataset: str, batch_size: int, threads: int, root: Path | str = CACHE,
                    refresh: bool = False, windows: int = WINDOWS, window_s: float = WINDOW_S) -> Profile:
    """The profile at ``threads`` CPU threads at ``batch_size // 8`` (at least 2) and ``batch_size`` samples, cached."""
    where, key = _cache(model, dataset, batch_size, threads, root)
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):  # none, old or damaged: measure
        summary = None if refresh else load_run(where).summary
        if summary and summary["config"].get("key") == key:
            return profile_from_dict(summary["metrics"]["profile"])
    info = kdata.dataset_info(dataset)
    net = kmodels.get_model(model, info.num_classes, info.in_channels, info.image_size)
    seq, shape = kmodels.to_sequential(net).train(), (info.in_channels, info.image_size, info.image_size)
    small = max(2, batch_size // 8)  # BatchNorm needs two samples
    sizes = (small, max(batch_size, small + 1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = int(process_memory_gb()[0] * 2**30)
        torch.manual_seed(0)
        times = [_layer_times(copy.deepcopy(seq), torch.randn(b, *shape), repeats=3) for b in sizes]
        saved = [s // sizes[0] for s in estimate_layer_memory(seq, torch.randn(sizes[0], *shape), param_scale=0)]
        data_s, update_s, whole = loop_costs(copy.deepcopy(seq), dataset, sizes, 5, windows, window_s)
        n = copies(threads)  # κ: the mean over the n processes that fill the cores, at least 1 (one process: 1)
        kappa = max(1.0, statistics.fmean(run_ranks(_together_rank, n, copy.deepcopy(seq), dataset, sizes[1], windows,
                                                    threads, window_s, timeout=600))) if n > 1 else 1.0
    finally:
        torch.set_num_threads(before)
    s0, s1 = [max(0.0, whole[k] - update_s * sum(p.nbytes for p in seq.parameters()) - data_s * sizes[k]) /
              max(1e-12, sum(f + b for f, b, _ in times[k])) for k in range(2)]  # scale(b) at both sizes
    def line(t0: float, t1: float) -> tuple[float, float]:  # (a, c) of t = a + c·b through both sizes, a, c >= 0
        c = max(0.0, (t1 * s1 - t0 * s0) / (sizes[1] - sizes[0]))
        return max(0.0, t0 * s0 - c * sizes[0]), c
    layers = [LayerProfile(name, type(layer).__name__, line(f0, f1), line(b0, b1),
                           sum(p.nbytes for p in layer.parameters()), out, held,
                           sum(1 for m in layer.modules() if any(True for _ in m.parameters(recurse=False))),
                           sum(1 for _ in layer.buffers()), sum(t.nbytes for t in layer.buffers()))
              for (name, layer), (f0, b0, out), (f1, b1, _), held in zip(seq.named_children(), *times, saved)]
    pairs = linear_pairs(list(seq))
    features = len(net.features) if isinstance(getattr(net, "features", None), nn.Sequential) else None
    prof = Profile(model, dataset, threads, sizes, layers, 4 * math.prod(shape), update_s, data_s, base, features,
                   pairs, [seq[i].out_features for i, _ in pairs], kappa)
    return save_profile(prof, batch_size, root)


def save_profile(prof: Profile, batch_size: int, root: Path | str = CACHE) -> Profile:
    """Write ``prof`` as a run where :func:`load_or_measure` finds it; returns it."""
    where, key = _cache(prof.model, prof.dataset, batch_size, prof.threads, root)
    RunWriter(where).finish(f"profile {prof.model}", "profile", {"key": key}, {"profile": asdict(prof)})
    return prof


def fit_kind(kind: str, points, ranks: int) -> tuple[float, float]:
    """``(α, β)`` of a ``kind`` collective over ``ranks`` ranks from ``[(n bytes, seconds), ...]``: the line
    ``T(n) = a + c·n`` through them; ``α = a / m``, ``β = c / s``, ``(m, s)`` = ``ring_counts(kind, ranks)``."""
    a, c = fit_alpha_beta(*zip(*points))
    messages, share = ring_counts(kind, ranks)
    return a / messages, c / share


def _fit_rank(env, windows: int, calls: int) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))  # as the plans' ranks run
    rank, p, device = env.rank, env.world_size, kdist.comm_device()  # NCCL takes CUDA tensors only
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    m = torch.randn(128, 128, device=device)
    reps = torch.tensor([max(1, round(WORK_S / timed(lambda: (m @ m, sync()), 5, 0.5, window_s=0.01)))])
    reps = int(kdist.all_reduce(reps, op=dist.ReduceOp.MIN).item())  # the same work on every rank

    def work() -> None:  # what a step computes between two collectives
        for _ in range(reps):
            m @ m
        sync()

    points: dict[str, list] = {kind: [] for kind in KINDS}
    for nbytes in FIT_SIZES:
        n = max(p, nbytes // 4 // p * p)  # elements, divisible by p
        full, send, recv, shard = (torch.zeros(k, device=device) for k in (n, n, n, n // p))

        def ring_step():
            ops = [dist.P2POp(dist.irecv, recv, (rank - 1) % p), dist.P2POp(dist.isend, send, (rank + 1) % p)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        collective = {"p2p": ring_step, "all_reduce": lambda: dist.all_reduce(full),
                      "reduce_scatter": lambda: kdist.reduce_scatter_tensor(shard, full),
                      "all_gather": lambda: kdist.all_gather_into_tensor(full, shard),
                      "broadcast": lambda: dist.broadcast(full, 0)}
        for kind in KINDS:
            extra, call = [], collective[kind]
            for _ in range(windows):  # paired windows: a slow spell of the machine falls on both
                alone = timed(lambda _: work(), 1, setup=dist.barrier, calls=calls)
                extra.append(timed(lambda _: (work(), call(), sync()), 1, setup=dist.barrier, calls=calls) - alone)
            slowest = torch.tensor(statistics.median(extra), dtype=torch.float64)
            slowest = kdist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if slowest.item() > 0 or kind == "p2p":  # a cost lost in the computing's noise says nothing
                points[kind].append((n * 4, max(slowest.item(), 1e-6)))
    fitted = {k: dict(zip(("alpha", "beta"), fit_kind(k, v, p))) for k, v in points.items() if len(v) >= 2}
    a, b = torch.zeros(1 << 20), torch.ones(1 << 20)
    gamma = kdist.all_reduce(torch.tensor(timed(lambda: a.add_(b), 5, 0.0) / (a.numel() * 4), dtype=torch.float64))
    return {**fitted.pop("p2p"), "gamma": gamma.item() / p, "p2p": points["p2p"], "kinds": fitted}


def measure_link(ranks: int, out: Path, refresh: bool = False, windows: int = FIT_WINDOWS,
                 calls: int = CALLS) -> tuple[CostModel, dict]:
    """``(link, kinds)``: the α-β-γ fit and each kind's α-β (:func:`fit_kind`) over ``ranks`` ranks, read from the run
    at ``out``, else (or with ``refresh``) fitted on spawned gloo ranks and written there: each of ``KINDS`` timed at
    :data:`FIT_SIZES` after :data:`WORK_S` of computing, less that computing alone, on the slowest rank; sizes lost
    in that computing's noise left out (a kind left with under two pays the point-to-point link)."""
    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0), {}
    fit = None
    with contextlib.suppress(FileNotFoundError, ValueError):
        fit = None if refresh else {r["world_size"]: r for r in load_run(out).records_of("cost-model")}.get(ranks)
    if not fit or not fit.get("kinds"):
        fit = run_ranks(_fit_rank, ranks, windows, calls, timeout=300)[0]
        writer = RunWriter(out)
        writer.log({"kind": "cost-model", "world_size": ranks, **fit})
        writer.finish(f"links {ranks}", "cost-model", {"ranks": ranks}, {k: v for k, v in fit.items() if k != "p2p"})
    return (CostModel(fit["alpha"], fit["beta"], fit.get("gamma", 0.0)),
            {k: CostModel(v["alpha"], v["beta"]) for k, v in fit["kinds"].items()})


def local_topology(ranks: int, link: CostModel | None = None, cache: str | Path = CACHE, refresh: bool = False,
                   fit: dict | None = None) -> Topology:
    """``ranks`` gloo ranks on this machine; ``link`` for every kind of collective, else one per kind, cached or
    measured by :func:`measure_link` (``refresh``; ``fit``: its ``windows``, ``calls``)."""
    link, kinds = (link, {}) if link else measure_link(ranks, Path(cache, f"links-{ranks}"), refresh, **(fit or {}))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks
    return Topology(f"{ranks} gloo rank(s) on this host", ranks, link, memory, "cpu", os.cpu_count() or 1, kinds=kinds)

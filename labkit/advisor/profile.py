"""The model's side of the advisor's measurement, per layer ``i`` of its flat ``nn.Sequential`` form: its bytes
(parameters, output per sample: what crosses a cut, saved per sample: what autograd keeps) and its forward and
backward times at two batch sizes, fitted to lines so every batch a plan uses (``B``, ``B/p``, ``B/m``) has a price:

    fwd_i(b) = fwd0_i + fwd1_i · b          bwd_i(b) = bwd0_i + bwd1_i · b      (fwd0: what any micro-batch pays)

Layers timed alone give the shape; ``labkit train``'s own step, timed back to back in one process, the level
(:func:`loop_costs`):

    scale(b) = (step(b) − update(P) − data(b)) / Σ_i (fwd_i + bwd_i)(b)
    update(P) = update_s_per_byte · P      data(b) = data_s_per_sample · b

and :func:`together` what processes computing at once pay (on every plan of several processes' compute,
:func:`labkit.advisor.alphabeta.compute_scale`): ``κ = step of each of n processes stepping at once / its step
alone`` (``n = cores // threads``). Cached as a run (``summary.json`` kind ``"profile"``, one ``"layer"`` record
per layer), reused while model, dataset, sizes, threads, host, torch version and :data:`FORMAT` match.
"""
from __future__ import annotations

import copy
import math
import os
import statistics
from dataclasses import asdict
from itertools import chain, repeat
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from labkit import data as kdata
from labkit import models as kmodels
from labkit.advisor.measure import timed
from labkit.advisor.plan import LayerProfile, Profile, profile_from_dict
from labkit.errors import ConfigError
from labkit.meters import process_memory_gb
from labkit.results import RunWriter, load_run
from labkit.strategies.gpipe_balance import SavedActivations
from labkit.strategies.tensor_parallel import linear_pairs
from labkit.tensor_data import load_split
from labkit.testing import run_ranks
from labkit.train import lr_factor, single_strategy, train_step

CACHE = Path("runs") / "advisor"
FORMAT = 9  # other formats are measured again (7: levels alone, κ apart; 8: κ of synchronised steps; 9: the level
            # is labkit train's own step, no per-strategy terms)
WINDOWS, WINDOW_S = 9, 0.05  # timed windows (κ: paired rounds) of at least WINDOW_S s behind each level and κ


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _batches(train_set, b: int):
    """``labkit train``'s default loader (resident tensors) of ``b`` samples, epoch after epoch."""
    return chain.from_iterable(repeat(kdata.make_loader(train_set, b, shuffle=True, drop_last=True)))


def _layer_times(model: nn.Sequential, x: torch.Tensor, repeats: int) -> list[tuple[float, float]]:
    """(forward s, backward s) per layer on ``x``, each the median of ``repeats`` (a backward's forward untimed).
    Every layer's input needs a gradient, as in training, except the first's (the data)."""
    out = []
    for i, layer in enumerate(model):
        inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        forward = timed(lambda: layer(inp), repeats)
        grad = torch.randn_like(layer(inp))
        out.append((forward, timed(lambda y: y.backward(grad), repeats, setup=lambda: layer(inp))))
        x = layer(inp).detach()
    return out


def loop_step(model: nn.Module, batches):
    """``(step, optimizer)``: one step of ``labkit train``'s loop on the next of ``batches``
    (:func:`labkit.train.train_step`: forward, loss, backward, SGD with momentum, scheduler, metric sums)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 1000, [], 0.1, 0.0, 1.0))
    strategy, totals, criterion = single_strategy(model), torch.zeros(3, dtype=torch.float64), nn.CrossEntropyLoss()

    def step():
        x, y = next(batches)
        train_step(model, x, y, opt, strategy, criterion, totals, scheduler=scheduler)
    return step, opt


def loop_costs(model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int, windows: int = WINDOWS,
               window_s: float = WINDOW_S) -> tuple[float, float, list[float]]:
    """``(data_s_per_sample, update_s_per_byte, [step(b) for b in sizes])``: ``step(b)`` is :func:`loop_step` on
    ``labkit train``'s default loader, the lower quartile of ``windows`` windows of at least ``window_s``."""
    train_set = load_split("tensor", dataset, train=True)
    data, steps, opt = 0.0, [], None
    for b in sizes:
        batches = _batches(train_set, b)
        data = timed(lambda: next(batches), repeats, window_s=window_s) / b
        step, opt = loop_step(model, batches)
        step()  # warm-up: allocations
        timed(step, 2, window_s=window_s)  # and the thread pool and caches: a process's first windows run slower
        steps.append(timed(step, windows, 0.25, window_s))
    return data, timed(opt.step, repeats, window_s=window_s) / max(1, _bytes(model.parameters())), steps


def copies(threads: int) -> int:
    """``n = cores // threads`` (at least 1): the processes of ``threads`` threads each that fill the cores."""
    return max(1, (os.cpu_count() or 1) // max(1, threads))


def _together_rank(env, model: nn.Sequential, dataset: str, batch: int, rounds: int, threads: int,
                   window_s: float) -> float:
    torch.set_num_threads(threads)
    step, _ = loop_step(model, _batches(load_split("tensor", dataset, train=True), batch))

    def synced():  # a step of a plan of several processes ends when the last of them is done
        step()
        dist.barrier()

    step()
    slowest = torch.tensor([timed(step, 2, window_s=window_s)])  # and the thread pool and caches warm
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    calls = max(1, math.ceil(window_s / max(slowest.item(), 1e-6)))  # the same on every rank
    ratios = []
    for _ in range(rounds):  # each rank alone in turn (the others asleep in its barriers), then all at once
        alone = [timed(synced if turn == env.rank else dist.barrier, 1, calls=calls) for turn in range(env.world_size)]
        ratios.append(timed(synced, 1, calls=calls) / alone[env.rank])
    return statistics.median(ratios)


def together(model: nn.Sequential, dataset: str, batch: int, rounds: int, processes: int,
             window_s: float = WINDOW_S) -> float:
    """``κ = step of each of n processes stepping at once / its step alone`` for ``n = processes`` spawned ranks at
    this process's threads (one process: 1), each stepping ``model`` on ``batch`` samples (:func:`loop_step`, then a
    barrier): ``rounds`` rounds of a window of each rank alone, then one of all at once, as many steps in each; the
    mean over the ranks of each one's median ratio, at least 1."""
    if processes <= 1:
        return 1.0
    runs = run_ranks(_together_rank, processes, model, dataset, batch, rounds, torch.get_num_threads(), window_s,
                     timeout=600)
    return max(1.0, statistics.fmean(runs))


def _line(b0: int, t0: float, b1: int, t1: float) -> tuple[float, float]:
    """``(a, c)`` with ``t = a + c·b`` through two points, kept physical (a, c >= 0)."""
    c = max(0.0, (t1 - t0) / (b1 - b0))
    return max(0.0, t0 - c * b0), c


def measure_profile(model: str, dataset: str, batch_size: int, threads: int, repeats: int = 3,
                    windows: int = WINDOWS, window_s: float = WINDOW_S) -> Profile:
    """Profile ``model`` on ``dataset`` shapes at ``threads`` CPU threads (one rank's share of the cores, restored
    after) at ``batch_size`` (the largest batch a plan gives one device) and ``batch_size // 8``; ``windows`` and
    ``window_s`` time each level and κ (fewer and shorter: quicker and noisier, as notebook 08's quick mode)."""
    info = kdata.dataset_info(dataset)
    seq = kmodels.get_model(model, info.num_classes, info.in_channels, info.image_size, sequential=True)
    features = getattr(kmodels.get_model(model, info.num_classes, info.in_channels, info.image_size), "features", None)
    small = max(2, batch_size // 8)  # BatchNorm needs two samples
    sizes = (small, max(batch_size, small + 1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = int(process_memory_gb()[0] * 2**30)
        torch.manual_seed(0)
        shape = (info.in_channels, info.image_size, info.image_size)
        times = [_layer_times(copy.deepcopy(seq).train(), torch.randn(b, *shape), repeats) for b in sizes]
        outs, saved, x = [], [], torch.randn(sizes[0], *shape)
        for layer in copy.deepcopy(seq).train():
            with SavedActivations(exclude=list(layer.parameters())) as meter:
                x = layer(x.detach().requires_grad_())
            outs.append(x[0].numel() * x.element_size())
            saved.append(meter.peak_bytes // sizes[0])
        data_s, update_s, whole = loop_costs(copy.deepcopy(seq).train(), dataset, sizes, max(5, repeats), windows,
                                             window_s)
        kappa = together(copy.deepcopy(seq).train(), dataset, sizes[1], windows, copies(threads), window_s)
    finally:
        torch.set_num_threads(before)
    s0, s1 = [max(0.0, whole[k] - update_s * _bytes(seq.parameters()) - data_s * sizes[k]) /
              max(1e-12, sum(f + b for f, b in times[k])) for k in range(2)]  # scale(b) at both sizes
    lines = [[_line(sizes[0], t0 * s0, sizes[1], t1 * s1) for t0, t1 in zip(*at)] for at in zip(*times)]  # fwd, bwd
    layers = [LayerProfile(name, type(layer).__name__, *lines[i], _bytes(layer.parameters()), outs[i], saved[i],
                           sum(1 for m in layer.modules() if any(True for _ in m.parameters(recurse=False))),
                           sum(1 for _ in layer.buffers()), _bytes(layer.buffers()))
              for i, (name, layer) in enumerate(seq.named_children())]
    pairs = linear_pairs(list(seq))
    return Profile(model, dataset, threads, sizes, layers, int(torch.Size(shape).numel() * 4), update_s, data_s,
                   base, len(features) if isinstance(features, nn.Sequential) else None, pairs,
                   [seq[i].out_features for i, _ in pairs], kappa)


def _cache(model: str, dataset: str, batch_size: int, threads: int, root: Path | str) -> tuple[Path, dict]:
    """(folder, key): where a profile is cached and what it must have been measured with to be reused."""
    return Path(root) / f"profile-{model}-{dataset}-b{batch_size}-t{threads}", {
        "format": FORMAT, "model": model, "dataset": dataset, "batch_size": batch_size, "threads": threads,
        "torch": torch.__version__, "host": os.uname().nodename}


def load_or_measure(model: str, dataset: str, batch_size: int, threads: int, root: Path | str = CACHE,
                    refresh: bool = False, repeats: int = 3, **timing) -> Profile:
    """The cached profile if it was measured here with these settings, else a fresh one (then cached; ``timing``:
    :func:`measure_profile`'s ``windows`` and ``window_s``)."""
    if model not in kmodels.MODELS:
        raise ConfigError(f"unknown model {model!r}; choose one of: {', '.join(kmodels.MODELS)}")
    where, key = _cache(model, dataset, batch_size, threads, root)
    if not refresh and (where / "summary.json").exists():
        try:
            summary = load_run(where).summary
            if summary["config"].get("key") == key:
                return profile_from_dict(summary["metrics"]["profile"])
        except (ValueError, KeyError, TypeError):
            pass  # an old or damaged cache is measured again
    prof = measure_profile(model, dataset, batch_size, threads, repeats, **timing)
    save_profile(prof, batch_size, root)
    return prof


def save_profile(prof: Profile, batch_size: int, root: Path | str = CACHE) -> Path:
    """Write ``prof`` as a run (``"layer"`` records + summary) where :func:`load_or_measure` finds it."""
    where, key = _cache(prof.model, prof.dataset, batch_size, prof.threads, root)
    writer = RunWriter(where)
    for layer in prof.layers:
        writer.log({"kind": "layer", **asdict(layer)})
    writer.finish(f"profile {prof.model}", "profile", {"key": key}, {"profile": asdict(prof)})
    return where

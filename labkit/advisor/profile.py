"""Profile a model on this machine, layer by layer of its flat ``nn.Sequential`` form: what the cost model prices.

Per layer ``i`` and batch size ``b`` the forward and backward times are measured at two batch sizes and
fitted to a line, so every batch a plan uses (``B``, ``B/p``, ``B/m``) has a price:

    fwd_i(b) = fwd0_i + fwd1_i · b          bwd_i(b) = bwd0_i + bwd1_i · b

(``fwd0`` is the per-call cost a micro-batch pays however small it is). A layer timed alone is not timed
as the training loop runs it: between two timed calls the CPU's worker threads go to sleep, and on a busy
machine waking them costs more than a small layer's work. So the layers give the *shape* and whole steps
give the *level*: at each size ``b`` the bare training step (the next batch from the loader, forward, loss,
backward, optimizer) is timed back to back, the lower quartile of at least 9 windows of at least 50 ms
(shorter windows are all luck on a shared machine; other programs only ever slow a window down), and every
layer's time is scaled by

    scale(b) = (step(b) − update(P) − data(b)) / Σ_i (fwd_i + bwd_i)(b)

so the layers sum to what the loop spends on them. The steps are timed in as many processes at once as fill the
cores at the profile's thread count (:func:`_copies`), each stepping its own copy, and averaged: a multi-process
plan's ranks all compute at the same time and share the caches and memory bandwidth (on 2 cores, one thread
each, LeNet's step at 64 samples took 1.13× as long with a second process stepping beside it; the
one-process plans' profile, two threads, is timed alone). Besides the layers:

    update(P)  = update_s_per_byte · P      optimizer step over P parameter bytes (SGD with momentum)
    data(b)    = data_s_per_sample · b      fetching b samples (``labkit train``'s default resident-tensor loader)
    loop       = loop_s                     the training loop's own bookkeeping per step (scheduler, metric sums)

Memory per layer: parameter bytes, output bytes per sample (what crosses a cut) and saved bytes per
sample (what autograd keeps for backward). A profile is cached as a run in the results schema
(``summary.json`` kind ``"profile"``, one ``"layer"`` record per layer) and reused when the model,
dataset, sizes, threads, host and torch version match.
"""
from __future__ import annotations

import copy
import os
import statistics
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from labkit import data as kdata
from labkit import models as kmodels
from labkit.advisor.measure import timed
from labkit.advisor.plan import LayerProfile, Profile, profile_from_dict
from labkit.errors import ConfigError
from labkit.meters import process_memory_gb
from labkit.results import RunWriter, load_run
from labkit.strategies.gpipe import SavedActivations
from labkit.strategies.tensor_parallel import ELEMENTWISE

CACHE = Path("runs") / "advisor"
WINDOW_S = 0.05      # the shortest timed window of back-to-back steps
FORMAT = 6           # profiles of another format are measured again (4: levels timed with the cores filled;
                     # 5: torchgpipe's price per micro-batch and partition; 6: the loop's bookkeeping)


def _backward_time(layer: nn.Module, inp: torch.Tensor, repeats: int) -> float:
    """The median backward of ``layer`` on ``inp`` (each forward untimed, before it)."""
    y = layer(inp)
    grad = torch.randn_like(y)
    return timed(lambda out: out.backward(grad), repeats, setup=lambda: layer(inp))


def _layer_times(model: nn.Sequential, x: torch.Tensor, repeats: int) -> tuple[list[tuple[float, float]], float]:
    """((forward s, backward s) per layer on ``x``, each the median of ``repeats`` after one warm-up; the first
    layer's input-gradient seconds). Every layer's input needs a gradient, as in training, except the first's
    (the data); the first is also timed with one, and the difference returned."""
    out, input_grad = [], 0.0
    for i, layer in enumerate(model):
        inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        fwd = timed(lambda: layer(inp), repeats)
        first = i == 0 and x.is_floating_point()
        bwd = _backward_time(layer, inp, max(7, repeats) if first else repeats)
        if first:  # a difference of two timings: more repeats of both
            input_grad = max(0.0, _backward_time(layer, x.detach().requires_grad_(), max(7, repeats)) - bwd)
        out.append((fwd, bwd))
        x = layer(inp).detach()
    return out, input_grad


def _line(b0: int, t0: float, b1: int, t1: float) -> tuple[float, float]:
    """``(a, c)`` with ``t = a + c·b`` through two points, kept physical (a, c >= 0)."""
    c = max(0.0, (t1 - t0) / (b1 - b0))
    return max(0.0, t0 - c * b0), c


def _tp_pairs(model: nn.Sequential) -> list[tuple[int, int]]:
    """Linear → elementwise… → Linear pairs as ``parallelize_linears`` forms them."""
    layers, pairs, i = list(model), [], 0
    while i < len(layers):
        j = i + 1
        while j < len(layers) and isinstance(layers[j], ELEMENTWISE):
            j += 1
        if isinstance(layers[i], nn.Linear) and j < len(layers) and isinstance(layers[j], nn.Linear):
            pairs.append((i, j))
            i = j + 1
        else:
            i += 1
    return pairs


def _loop_costs(model: nn.Sequential, dataset: str, sizes: tuple[int, int],
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
        batches = _endless(kdata.make_loader(train_set, b, shuffle=True, drop_last=True))
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


def _copies(threads: int) -> int:
    """Processes that step at once when each has ``threads`` threads and together they fill the cores, as the
    plans priced with a profile at ``threads`` run: one for two threads on two cores, two for one thread."""
    return max(1, (os.cpu_count() or 1) // max(1, threads))


def _loop_costs_rank(env, model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int, threads: int):
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.barrier()  # every copy starts its windows together
    return _loop_costs(model, dataset, sizes, repeats)


def _loop_costs_together(model: nn.Sequential, dataset: str, sizes: tuple[int, int], repeats: int,
                         copies: int) -> tuple[float, float, list[float], float]:
    """:func:`_loop_costs` in ``copies`` processes at once, each on its own copy of ``model`` at this process's
    thread count; each number the mean over the copies (one copy: timed here)."""
    if copies <= 1:
        return _loop_costs(model, dataset, sizes, repeats)
    from labkit.testing import run_ranks

    runs = run_ranks(_loop_costs_rank, copies, model, dataset, sizes, repeats, torch.get_num_threads(), timeout=600)
    return (statistics.fmean(r[0] for r in runs), statistics.fmean(r[1] for r in runs),
            [statistics.fmean(r[2][k] for r in runs) for k in range(len(sizes))], statistics.fmean(r[3] for r in runs))


GPIPE_PARTITIONS, GPIPE_MICROBATCHES = 2, 4


def _gpipe_task_time(repeats: int) -> float:
    """``h_g`` (see :class:`Profile`): torchgpipe's seconds per micro-batch and partition, at this process's
    threads."""
    from labkit.strategies.gpipe import make_gpipe

    def tiny() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))

    x, y = torch.randn(64, 16), torch.randint(0, 10, (64,))
    criterion = nn.CrossEntropyLoss()

    def step_time(model: nn.Module) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            opt.step()

        step()
        timed(step, 2, window_s=WINDOW_S)
        return timed(step, max(9, repeats), 0.25, WINDOW_S)

    k, m = GPIPE_PARTITIONS, GPIPE_MICROBATCHES
    pipe = make_gpipe(tiny(), ["cpu"] * k, m, "except_last", [2, 1])
    return max(0.0, step_time(pipe) - step_time(tiny())) / (m * k)


def _endless(loader):
    while True:
        yield from loader


def measure_profile(model: str, dataset: str, batch_size: int, threads: int, repeats: int = 3) -> Profile:
    """Profile ``model`` on ``dataset`` shapes at ``threads`` CPU threads (one rank's share of the cores).

    Args:
        batch_size: the largest batch a plan gives one device; layers are also timed at ``batch_size // 8``.
        threads: ``torch.set_num_threads`` during the measurement (restored after).
    """
    info = kdata.dataset_info(dataset)
    seq = kmodels.get_model(model, info.num_classes, info.in_channels, info.image_size, sequential=True)
    plain = kmodels.get_model(model, info.num_classes, info.in_channels, info.image_size)
    features = getattr(plain, "features", None)
    small = max(2, batch_size // 8)  # BatchNorm needs two samples
    sizes = (small, max(batch_size, small + 1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        base = int(process_memory_gb()[0] * 2**30)
        torch.manual_seed(0)
        shape = (info.in_channels, info.image_size, info.image_size)
        timed, input_grad = zip(*(_layer_times(copy.deepcopy(seq).train(), torch.randn(b, *shape), repeats)
                                  for b in sizes))
        outs, saved, x = [], [], torch.randn(sizes[0], *shape)
        for layer in copy.deepcopy(seq).train():
            with SavedActivations(exclude=list(layer.parameters())) as meter:
                x = layer(x.detach().requires_grad_())
            outs.append(x[0].numel() * x.element_size())
            saved.append(meter.peak_bytes // sizes[0])
        data_s, update_s, whole, loop_s = _loop_costs_together(copy.deepcopy(seq).train(), dataset, sizes,
                                                               max(5, repeats), _copies(threads))
        gpipe_task = _gpipe_task_time(repeats)
    finally:
        torch.set_num_threads(before)
    param_bytes = sum(p.numel() * p.element_size() for p in seq.parameters())
    scale = [max(0.0, whole[k] - update_s * param_bytes - data_s * sizes[k]) /
             max(1e-12, sum(f + b for f, b in timed[k])) for k in range(2)]
    timed = [[(f * scale[k], b * scale[k]) for f, b in timed[k]] for k in range(2)]
    input_grad = _line(sizes[0], input_grad[0] * scale[0], sizes[1], input_grad[1] * scale[1])
    layers = [LayerProfile(name, type(layer).__name__,
                           _line(sizes[0], timed[0][i][0], sizes[1], timed[1][i][0]),
                           _line(sizes[0], timed[0][i][1], sizes[1], timed[1][i][1]),
                           sum(p.numel() * p.element_size() for p in layer.parameters()), outs[i], saved[i],
                           sum(1 for m in layer.modules() if any(True for _ in m.parameters(recurse=False))),
                           sum(1 for _ in layer.buffers()), sum(b.numel() * b.element_size() for b in layer.buffers()))
              for i, (name, layer) in enumerate(seq.named_children())]
    pairs = _tp_pairs(seq)
    prof = Profile(model, dataset, threads, sizes, layers, int(torch.Size(shape).numel() * 4), update_s, data_s,
                   base, len(features) if isinstance(features, nn.Sequential) else None, pairs,
                   [seq[i].out_features for i, _ in pairs], input_grad, gpipe_task, loop_s)
    return prof


def _cache_dir(model: str, dataset: str, batch_size: int, threads: int, root: Path) -> Path:
    return Path(root) / f"profile-{model}-{dataset}-b{batch_size}-t{threads}"


def load_or_measure(model: str, dataset: str, batch_size: int, threads: int, root: Path | str = CACHE,
                    refresh: bool = False, repeats: int = 3) -> Profile:
    """The cached profile if it was measured here with these settings, else a fresh one (then cached)."""
    if model not in kmodels.MODELS:
        raise ConfigError(f"unknown model {model!r}; choose one of: {', '.join(kmodels.MODELS)}")
    where = _cache_dir(model, dataset, batch_size, threads, Path(root))
    if not refresh and (where / "summary.json").exists():
        try:
            run = load_run(where)
            if run.summary["config"].get("key") == _key(model, dataset, batch_size, threads):
                return profile_from_dict(run.summary["metrics"]["profile"])
        except (ValueError, KeyError, TypeError):
            pass  # an old or damaged cache is measured again
    prof = measure_profile(model, dataset, batch_size, threads, repeats)
    save_profile(prof, batch_size, root)
    return prof


def _key(model: str, dataset: str, batch_size: int, threads: int) -> dict:
    return {"format": FORMAT, "model": model, "dataset": dataset, "batch_size": batch_size, "threads": threads,
            "torch": torch.__version__, "host": os.uname().nodename}


def save_profile(prof: Profile, batch_size: int, root: Path | str = CACHE) -> Path:
    """Write ``prof`` as a run (``"layer"`` records + summary) where :func:`load_or_measure` finds it."""
    where = _cache_dir(prof.model, prof.dataset, batch_size, prof.threads, Path(root))
    writer = RunWriter(where)
    for layer in prof.layers:
        writer.log({"kind": "layer", **asdict(layer)})
    writer.finish(f"profile {prof.model}", "profile", {"key": _key(prof.model, prof.dataset, batch_size, prof.threads)},
                  {"profile": asdict(prof)})
    return where

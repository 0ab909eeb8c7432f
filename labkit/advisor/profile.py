"""Profile a model on this machine, layer by layer of its flat ``nn.Sequential`` form: what the cost model prices.

Per layer ``i`` and batch size ``b`` the forward and backward times are measured at two batch sizes and
fitted to a line, so every batch a plan uses (``B``, ``B/p``, ``B/m``) has a price:

    fwd_i(b) = fwd0_i + fwd1_i · b          bwd_i(b) = bwd0_i + bwd1_i · b

(``fwd0`` is the per-call cost a micro-batch pays however small it is). A layer timed alone is not timed
as the training loop runs it: between two timed calls the CPU's worker threads go to sleep, and on a busy
machine waking them costs more than a small layer's work. So the layers give the *shape* and whole steps
give the *level*: at each size ``b`` ``labkit train``'s own step (the next batch from the loader, forward, loss,
backward, optimizer, scheduler, metric sums) is timed back to back, the lower quartile of 9 windows of at least
50 ms (``windows``, ``window_s``; shorter windows are all luck on a shared machine; other programs only ever slow
a window down), and every layer's time is scaled by

    scale(b) = (step(b) − update(P) − data(b)) / Σ_i (fwd_i + bwd_i)(b)

so the layers sum to what the loop spends on them, in one process alone. A plan's ranks compute at the same
time and share the cores' caches and memory bandwidth, and on a shared machine the cores' time itself (the
scheduler's fair share goes to each session, not to each process): the profile measures that once,

    κ = step of each of n processes stepping at once / its step alone      (n = cores // threads)

(:func:`labkit.advisor.loop_costs.together`, paired windows of the step at the larger size), and every
plan of several processes pays it on its compute (:func:`labkit.advisor.alphabeta.compute_scale`). On 2 cores
at one thread, with other sessions busy (load 5 to 13): κ = 1.5 to 2.2 for LeNet and AlexNet-small at 64
samples (two processes then get little more than what one alone gets). Besides the layers:

    update(P)  = update_s_per_byte · P      optimizer step over P parameter bytes (SGD with momentum)
    data(b)    = data_s_per_sample · b      fetching b samples (``labkit train``'s default resident-tensor loader)

Memory per layer: parameter bytes, output bytes per sample (what crosses a cut) and saved bytes per
sample (what autograd keeps for backward). A profile is cached as a run in the results schema
(``summary.json`` kind ``"profile"``, one ``"layer"`` record per layer) and reused when the model,
dataset, sizes, threads, host and torch version match.
"""
from __future__ import annotations

import copy
import os
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from labkit import data as kdata
from labkit import models as kmodels
from labkit.advisor.loop_costs import WINDOW_S, WINDOWS, copies, loop_costs, together
from labkit.advisor.measure import timed
from labkit.advisor.plan import LayerProfile, Profile, profile_from_dict
from labkit.errors import ConfigError
from labkit.meters import process_memory_gb
from labkit.results import RunWriter, load_run
from labkit.strategies.gpipe_balance import SavedActivations
from labkit.strategies.tensor_parallel import linear_pairs

CACHE = Path("runs") / "advisor"
FORMAT = 9           # profiles of another format are measured again (7: levels alone, κ apart; 8: κ of
                     # synchronised steps; 9: the level is labkit train's own step, no per-strategy terms)


def _backward_time(layer: nn.Module, inp: torch.Tensor, repeats: int) -> float:
    """The median backward of ``layer`` on ``inp`` (each forward untimed, before it)."""
    y = layer(inp)
    grad = torch.randn_like(y)
    return timed(lambda out: out.backward(grad), repeats, setup=lambda: layer(inp))


def _layer_times(model: nn.Sequential, x: torch.Tensor, repeats: int) -> list[tuple[float, float]]:
    """(forward s, backward s) per layer on ``x``, each the median of ``repeats`` after one warm-up. Every layer's
    input needs a gradient, as in training, except the first's (the data)."""
    out = []
    for i, layer in enumerate(model):
        inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        out.append((timed(lambda: layer(inp), repeats), _backward_time(layer, inp, repeats)))
        x = layer(inp).detach()
    return out


def _line(b0: int, t0: float, b1: int, t1: float) -> tuple[float, float]:
    """``(a, c)`` with ``t = a + c·b`` through two points, kept physical (a, c >= 0)."""
    c = max(0.0, (t1 - t0) / (b1 - b0))
    return max(0.0, t0 - c * b0), c


def measure_profile(model: str, dataset: str, batch_size: int, threads: int, repeats: int = 3,
                    windows: int = WINDOWS, window_s: float = WINDOW_S) -> Profile:
    """Profile ``model`` on ``dataset`` shapes at ``threads`` CPU threads (one rank's share of the cores).

    Args:
        batch_size: the largest batch a plan gives one device; layers are also timed at ``batch_size // 8``.
        threads: ``torch.set_num_threads`` during the measurement (restored after).
        windows, window_s: how many windows of at least how many seconds time each level and κ (fewer and
            shorter: a quicker, noisier profile, as notebook 08's quick mode takes).
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
        timed = [_layer_times(copy.deepcopy(seq).train(), torch.randn(b, *shape), repeats) for b in sizes]
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
    param_bytes = sum(p.numel() * p.element_size() for p in seq.parameters())
    scale = [max(0.0, whole[k] - update_s * param_bytes - data_s * sizes[k]) /
             max(1e-12, sum(f + b for f, b in timed[k])) for k in range(2)]
    timed = [[(f * scale[k], b * scale[k]) for f, b in timed[k]] for k in range(2)]
    layers = [LayerProfile(name, type(layer).__name__,
                           _line(sizes[0], timed[0][i][0], sizes[1], timed[1][i][0]),
                           _line(sizes[0], timed[0][i][1], sizes[1], timed[1][i][1]),
                           sum(p.numel() * p.element_size() for p in layer.parameters()), outs[i], saved[i],
                           sum(1 for m in layer.modules() if any(True for _ in m.parameters(recurse=False))),
                           sum(1 for _ in layer.buffers()), sum(b.numel() * b.element_size() for b in layer.buffers()))
              for i, (name, layer) in enumerate(seq.named_children())]
    pairs = linear_pairs(list(seq))
    prof = Profile(model, dataset, threads, sizes, layers, int(torch.Size(shape).numel() * 4), update_s, data_s,
                   base, len(features) if isinstance(features, nn.Sequential) else None, pairs,
                   [seq[i].out_features for i, _ in pairs], kappa)
    return prof


def _cache_dir(model: str, dataset: str, batch_size: int, threads: int, root: Path) -> Path:
    return Path(root) / f"profile-{model}-{dataset}-b{batch_size}-t{threads}"


def load_or_measure(model: str, dataset: str, batch_size: int, threads: int, root: Path | str = CACHE,
                    refresh: bool = False, repeats: int = 3, **timing) -> Profile:
    """The cached profile if it was measured here with these settings, else a fresh one (then cached; ``timing``:
    :func:`measure_profile`'s ``windows`` and ``window_s``)."""
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
    prof = measure_profile(model, dataset, batch_size, threads, repeats, **timing)
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

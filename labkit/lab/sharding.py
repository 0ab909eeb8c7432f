"""Measure DDP, ZeRO stages 1-3 and FSDP2 side by side on one job (notebook 07, ``labkit.dist.testing.run_ranks``).

    rows = run_ranks(measure, 2, "mlp", "adam")      # one dict per rank
    rows[0]["zero-3"]["memory"]                      # {"params": bytes, "grads": bytes, "optimizer": bytes}

Every contender trains the same model on the same random batches through :func:`labkit.train.loop.fit`, so
their weights can be compared with DDP's, and reports what this rank holds after the last step and the bytes
it sent per step (ZeRO's collectives count them; DDP's all-reduce is ZeRO's formula 2(N−1)/N · 4Ψ).

    sweep = run_ranks(bucket_sweep, 2, [1e-6, 0.05, 25])[0]   # ZeRO's bucket size: collectives and step time
    rows = run_ranks(measure, 2, sweep=[1e-6, 0.05, 25])       # both in one job: rows[0]["sweep"]

:func:`bucket_sweep` trains ZeRO with several ``--bucket-mb`` and counts its collectives per step beside the α-β
price of each layout (:func:`predicted_seconds`, α and β fitted on the job's own link by :func:`link_alpha_beta`).
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from labkit.advisor.topology import ring_counts
from labkit.collectives.cost import fit_alpha_beta
from labkit.dist import group as kdist
from labkit.models import cnn as models
from labkit.optim import OptimizerSpec
from labkit.parallel.zero_units import Comm
from labkit.strategies import get_strategy
from labkit.train.loop import fit

CONTENDERS = {"ddp": ("ddp", {"allreduce": "native"}), "zero-1": ("zero", {"zero_stage": 1}),
              "zero-2": ("zero", {"zero_stage": 2}), "zero-3": ("zero", {"zero_stage": 3}), "fsdp": ("fsdp", {})}


def held_bytes(strategy, model, optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}``: bytes this rank holds (0-d step counters excluded)."""
    if strategy.name == "zero":
        return strategy.memory_bytes(optimizer)
    if strategy.name == "fsdp":
        return strategy.memory_bytes(model, optimizer)
    params = list(strategy.unwrap(model).parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer": sum(t.numel() * t.element_size() for t in state)}


def measure(env, model: str = "mlp", optimizer: str = "adam", steps: int = 2, batch_size: int = 8,
            sweep: list[float] | None = None, sweep_rounds: int = 2) -> dict:
    """Per contender: ``{"memory", "bytes_per_step" (ZeRO only), "max_diff_vs_ddp"}``; plus ``"parameters"``,
    and with ``sweep`` (bucket sizes in MB) :func:`bucket_sweep`'s result over ``sweep_rounds`` timed rounds as
    ``"sweep"`` (one job for both).

    FSDP2 needs a process group, so a single process (``env.distributed`` False) measures DDP and ZeRO only.
    """
    gen = torch.Generator().manual_seed(0)
    n = steps * batch_size * env.world_size
    data = TensorDataset(torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    out, reference = {}, None
    for name, (strategy_name, options) in CONTENDERS.items():
        if strategy_name == "fsdp" and not env.distributed:
            continue
        torch.manual_seed(0)
        strategy = get_strategy(strategy_name)(env, options)
        net = strategy.prepare(models.get_model(model))
        opt, _ = strategy.build_optimizer(net, OptimizerSpec(optimizer, 0.01, 0.9, 0.0, {}, env))
        loader = DataLoader(data, batch_size=batch_size, sampler=strategy.sampler(data, True, 0))
        sent = strategy.comm.sent_bytes if strategy_name == "zero" else 0
        fit(net, loader, None, opt, epochs=1, strategy=strategy, max_steps=steps, printer=lambda line: None)
        row = {"memory": held_bytes(strategy, net, opt)}
        if strategy_name == "zero":
            row["bytes_per_step"] = (strategy.comm.sent_bytes - sent) / steps
            params = strategy.full_parameters()
        elif strategy_name == "fsdp":
            params = strategy.full_parameters(net)
        else:
            params = [p.detach().clone() for p in strategy.unwrap(net).parameters()]
            reference = params
        row["max_diff_vs_ddp"] = max((p - q).abs().max().item() for p, q in zip(params, reference, strict=True))
        out[name] = row
    out["parameters"] = sum(p.numel() for p in reference)
    if sweep:
        out["sweep"] = bucket_sweep(env, sweep, rounds=sweep_rounds)
    return out


def _median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls, the ranks meeting before each."""
    return _medians({"": fn}, repeats)[""]


def _medians(calls: dict, repeats: int) -> dict[str, float]:
    """Median wall seconds of each of ``calls`` (name -> function), alternated ``repeats`` times, the ranks meeting
    before each call."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def collective_costs(numel: int, device: torch.device, repeats: int = 10) -> dict[str, float]:
    """Seconds per call of the collectives DDP and ZeRO send a bucket with, on this backend: ``all_reduce`` (DDP),
    ``reduce_scatter`` and ``all_gather`` (ZeRO's :class:`~labkit.parallel.zero_units.Comm`) of ``numel`` float32
    numbers (rounded up to a multiple of the ranks), alternated ``repeats`` times; per collective the median of
    the slowest rank.

    ZeRO-1 and ZeRO-2 move the bytes of an all-reduce as a reduce-scatter plus an all-gather; whether that costs
    what the all-reduce costs depends on how the backend implements the two (gloo's are slower than its all-reduce).
    """
    world = torch.distributed.get_world_size()
    comm = Comm(world, True)
    numel = -(-numel // world) * world
    full, gathered = torch.ones(numel, device=device), torch.empty(numel, device=device)
    shard = torch.empty(numel // world, device=device)
    done = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    seconds = _medians({"all_reduce": lambda: (kdist.all_reduce(full), done()),
                        "reduce_scatter": lambda: (comm.reduce_scatter(shard, full), done()),
                        "all_gather": lambda: (comm.all_gather(gathered, shard), done())}, repeats)
    slowest = kdist.all_reduce(torch.tensor(list(seconds.values()), dtype=torch.float64, device=device),
                               op=torch.distributed.ReduceOp.MAX)
    return dict(zip(seconds, slowest.tolist()))


def link_alpha_beta(env, sizes: tuple[int, ...] = (2**10, 2**16, 2**20), repeats: int = 7) -> dict:
    """``{"alpha", "beta"}`` of ZeRO's reduce-scatter + all-gather pairs (:class:`~labkit.parallel.zero_units.Comm`)
    over the job's ranks: the line
    ``T(n) = 2·((N − 1)·α + (N − 1)/N·n·β)`` fitted to the median time of a pair on buffers of ``n`` bytes
    (:func:`labkit.collectives.cost.fit_alpha_beta`; the ring counts of :func:`labkit.advisor.topology.ring_counts`)."""
    n = env.world_size
    comm = Comm(n, True)  # the collectives ZeRO calls, on the rank's device
    points = []
    for nbytes in sizes:
        full = torch.zeros(nbytes // 4 // n * n, device=env.device)
        shard = torch.zeros(full.numel() // n, device=env.device)

        def pair():
            comm.reduce_scatter(shard, full)
            comm.all_gather(full, shard)
        pair()
        points.append((full.numel() * 4, _median_seconds(pair, repeats)))
    a, c = fit_alpha_beta(*zip(*points))
    messages, share = ring_counts("reduce_scatter", n)
    return {"alpha": a / (2 * messages), "beta": c / (2 * share)}


def bucket_sweep(env, sizes_mb: list[float], model: str = "resnet20", stage: int = 2, steps: int = 2,
                 rounds: int = 2, batch_size: int = 8) -> dict:
    """ZeRO ``stage`` with each bucket size of ``sizes_mb``, the same model and batches: per size the buckets'
    padded bytes, the collectives per step (counted by its :class:`~labkit.parallel.zero_units.Comm`) and the median
    seconds of ``steps`` steps through :func:`labkit.train.loop.fit` (sizes alternated, ``rounds`` rounds); plus the
    link's ``alpha`` and ``beta`` (:func:`link_alpha_beta`) for the α-β prediction of the collectives' time.

    Returns ``{"rows": [{"bucket_mb", "buckets", "bucket_bytes", "calls_per_step", "step_s"}], "alpha", "beta",
    "modules"}`` (``modules``: the model's modules that own parameters).
    """
    gen = torch.Generator().manual_seed(0)
    n = steps * batch_size * env.world_size
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    runs = {}
    for size in sizes_mb:
        torch.manual_seed(0)
        strategy = get_strategy("zero")(env, {"zero_stage": stage, "bucket_mb": size})
        net = strategy.prepare(models.get_model(model, num_classes=10, in_channels=3, image_size=32))
        opt, _ = strategy.build_optimizer(net, OptimizerSpec("sgd", 0.01, 0.9, 0.0, {}, env))
        loader = DataLoader(data, batch_size=batch_size, sampler=strategy.sampler(data, True, 0))
        runs[size] = (strategy, net, opt, loader, [])
    modules = sum(1 for m in models.get_model(model, num_classes=10, in_channels=3, image_size=32).modules()
                  if any(p.requires_grad for p in m.parameters(recurse=False)))

    def train(size):
        strategy, net, opt, loader, _ = runs[size]
        fit(net, loader, None, opt, epochs=1, strategy=strategy, max_steps=steps, printer=lambda line: None)
    for size in sizes_mb:  # warm-up
        train(size)
    for r in range(rounds):
        shift = r % len(sizes_mb)
        for size in sizes_mb[shift:] + sizes_mb[:shift]:
            strategy = runs[size][0]
            calls = strategy.comm.calls
            runs[size][4].append((_median_seconds(lambda: train(size), 1) / steps,
                                  (strategy.comm.calls - calls) / steps))
    rows = []
    for size, (strategy, _, _, _, timed) in runs.items():
        per_step = {c for _, c in timed}
        rows.append({"bucket_mb": size, "buckets": len(strategy.buckets),
                     "bucket_bytes": [4 * b.full.numel() for b in strategy.buckets],
                     "calls_per_step": per_step.pop() if len(per_step) == 1 else sorted(per_step),
                     "step_s": statistics.median(t for t, _ in timed)})
    return {"rows": rows, **link_alpha_beta(env), "modules": modules}


def predicted_seconds(bucket_bytes: list[int], ranks: int, alpha: float, beta: float, stage: int = 2) -> float:
    """The α-β price of ZeRO's collectives per step for buckets of ``bucket_bytes``: per bucket a reduce-scatter and
    ``g`` all-gathers (``g = 2`` at stage 3, else 1), each ``(N − 1)·α + (N − 1)/N·U·β``."""
    gathers = 2 if stage == 3 else 1
    return sum((1 + gathers) * ((ranks - 1) * alpha + (ranks - 1) / ranks * u * beta) for u in bucket_bytes)

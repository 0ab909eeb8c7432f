"""A GPT's training memory measured beside its prediction (notebook 12): one step of
:func:`labkit.train.loop.train_step` (the step ``fit`` runs) under ``torch.distributed._tools.mem_tracker.MemTracker``,
on one process or on each rank of a mesh (``labkit.dist.testing.run_ranks``).

    rows = measure(None, CFG, 8, {"one process": {}, "full": {"recompute": "full"}})          # this process
    rows = run_ranks(measure, 2, CFG, 8, {"tp=2 sp": {"mesh": "tp=2", "sequence_parallel": True}})

Each configuration builds the same GPT (seed 0), prepares it for its mesh, takes one warm-up step (Adam's state
exists from then on) and then the measured one: MemTracker counts every tensor the step holds, by kind
(parameters, gradients, optimizer state, activations, temporaries), and its peak.
"""
from __future__ import annotations

import torch

from labkit.dist.group import DistEnv
from labkit.models.gpt import GPT
from labkit.models.recompute import set_recompute
from labkit.optim import OptimizerSpec
from labkit.strategies.base import Strategy
from labkit.train.loop import train_step
from labkit.train.tasks import LanguageModelling


def _strategy(env: DistEnv | None, options: dict):
    if env is None or not env.distributed:
        return Strategy(DistEnv())
    from labkit.parallel.mesh import MeshStrategy

    return MeshStrategy(env, options)


def peak_of_step(model, x, y, optimizer, strategy, criterion, task) -> dict[str, int]:
    """One :func:`train_step` under MemTracker: ``{"peak": bytes, kind: bytes at the peak, ..., "loss": the step's
    loss sum (0 on a rank that does not own the loss)}`` on this rank's device (the model, optimizer and batch
    registered before it starts)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer, x, y)
    totals = torch.zeros(3, dtype=torch.float64)
    with tracker:
        train_step(model, x, y, optimizer, strategy, criterion, totals, task=task)
    snapshot = tracker.get_tracker_snapshot("peak")
    device = next(iter(snapshot))
    kinds = {str(getattr(k, "value", k)).lower(): int(v) for k, v in snapshot[device].items() if v}
    return {"peak": kinds.pop("total"), **kinds, "loss": float(totals[0])}


def measure(env: DistEnv | None, cfg, batch: int, runs: dict[str, dict]) -> dict[str, dict]:
    """Each of ``runs`` (label -> options: ``mesh`` and its flags as ``labkit train`` takes them, ``recompute``) on
    ``cfg`` (a :class:`~labkit.models.gpt.GPTConfig`) with ``batch`` sequences per data-parallel rank: this rank's
    :func:`peak_of_step` and its final loss, by label."""
    task = LanguageModelling()
    out = {}
    for label, options in runs.items():
        g = torch.Generator().manual_seed(1)  # the same batches for every configuration
        options = dict(options)
        recompute = options.pop("recompute", "none")
        strategy = _strategy(env, options)
        torch.manual_seed(0)
        model = strategy.prepare(set_recompute(GPT(cfg), recompute))
        optimizer, _ = strategy.build_optimizer(model, OptimizerSpec("adam", 1e-3, 0.9))
        dp = strategy.data_parallel_size
        tokens = torch.randint(0, cfg.vocab_size, (2, batch * dp, cfg.block_size + 1), generator=g)
        rank = strategy.data_shard()[1] if hasattr(strategy, "data_shard") else 0
        x, y = (tokens[..., :-1], tokens[..., 1:])
        shard = slice(rank * batch, (rank + 1) * batch)
        criterion = task.criterion()
        totals = torch.zeros(3, dtype=torch.float64)
        train_step(model, x[0, shard], y[0, shard], optimizer, strategy, criterion, totals, task=task)  # warm-up
        out[label] = peak_of_step(model, x[1, shard], y[1, shard], optimizer, strategy, criterion, task)
    return out

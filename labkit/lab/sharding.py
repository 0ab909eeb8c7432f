"""Measure DDP, ZeRO stages 1-3 and FSDP2 side by side on one job (notebook 07, ``labkit.dist.testing.run_ranks``).

    rows = run_ranks(measure, 2, "mlp", "adam")      # one dict per rank
    rows[0]["zero-3"]["memory"]                      # {"params": bytes, "grads": bytes, "optimizer": bytes}

Every contender trains the same model on the same random batches through :func:`labkit.train.loop.fit`, so
their weights can be compared with DDP's, and reports what this rank holds after the last step and the bytes
it sent per step (ZeRO's collectives count them; DDP's all-reduce is ZeRO's formula 2(N−1)/N · 4Ψ).
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from labkit.models import cnn as models
from labkit.optim import OptimizerSpec
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


def measure(env, model: str = "mlp", optimizer: str = "adam", steps: int = 2, batch_size: int = 8) -> dict:
    """Per contender: ``{"memory", "bytes_per_step" (ZeRO only), "max_diff_vs_ddp"}``; plus ``"parameters"``.

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
    return out

"""One harness for SGD, Adam, K-FAC, Shampoo, SOAP and Muon (notebook 05b): the same model, data and batches, each
optimizer trained through :func:`labkit.train.loop.fit` in rounds of a few steps, the held-out loss measured after
every round (off the clock), and what each would hold and send on W data-parallel ranks counted.

Two budgets, one run per optimizer: an equal *step* budget (every optimizer trains at least ``steps`` steps) and an
equal *time* budget T (every optimizer trains on until the next round would take its own training clock past T;
the rounds inside T, and the steps they hold, are its time-budget run). A slow optimizer spends T before its
``steps`` steps (the step budget then carries on from the same state: no step is trained twice), a fast one gets
more steps than ``steps`` within T. Without a given T, T is the first optimizer's time for its ``steps`` steps.

    records = race(["sgd", "shampoo"], steps=100)
    records["shampoo"]["eval_loss"][records["shampoo"]["steps"].index(100)]   # held-out loss after 100 steps
    records["shampoo"]["budget"]       # {"seconds": T, "steps", "used_s", "eval_loss", "eval_acc"} of the time budget
    counted(records["shampoo"], world_size=8)      # {"state_bytes": per rank, "comm_bytes": per step per rank}
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from labkit.data.tensor import load_split
from labkit.optim import build_optimizer
from labkit.optim.kfac import distributed as kfac_dist
from labkit.optim.split import state_bytes
from labkit.train.loop import evaluate, fit, single_strategy

#: name -> (learning rate, options): each rate the best of a sweep ×⅓, ×1, ×3 on this harness (150 steps, mean
#: training loss of the last 30): sgd 0.05 (0.33 / 0.22 / 0.25 at 0.017 / 0.05 / 0.15), adam 0.009 (0.38 / 0.24 /
#: 0.20 at 0.001 / 0.003 / 0.009), kfac 0.05 (0.196 / 0.193 / 0.193), shampoo 9e-4 (0.28 / 0.16 / 0.13 at 1e-4 /
#: 3e-4 / 9e-4), soap 0.009 (1.48 / 0.21 / 0.11 at 0.001 / 0.003 / 0.009), muon 0.009 (1.27 / 0.26 / 0.11)
RECIPES: dict[str, tuple[float, dict]] = {
    "sgd": (0.05, {}), "adam": (0.009, {}),
    "kfac": (0.05, {"kfac_update_freq": 10, "kfac_damping": 0.03}),
    "shampoo": (9e-4, {"shampoo_update_freq": 10}), "soap": (0.009, {"soap_update_freq": 10}),
    "muon": (0.009, {}),
}
SPLIT = ("shampoo", "soap", "muon")


def digits(limit: int | None = None) -> tuple[TensorDataset, TensorDataset]:
    """mnist-sample's digits pooled to 14 × 14 and flattened (196 numbers): the training and the held-out split."""
    def pooled(train: bool) -> TensorDataset:
        split = load_split("tensor", "mnist-sample", train, limit=limit if train else None)
        return TensorDataset(F.avg_pool2d(split.data, 2).flatten(1), split.targets)

    return pooled(True), pooled(False)


def model() -> nn.Module:
    """196 → 64 → 64 → 10 with ReLUs, the same weights for every contender."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(196, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def race(names, steps: int, seconds: float | None = None, round_steps: int = 10, batch_size: int = 64,
         data=None) -> dict[str, dict]:
    """Train each optimizer on the same batches for a step budget of ``steps`` and a time budget of ``seconds``.

    Each trains in rounds of ``round_steps`` steps (one :func:`fit` call each, timed) while it has fewer than
    ``steps`` steps, or while its clock plus its last round's time is within T; after every round the held-out
    loss, off the clock. Its time-budget run is the rounds that ended within T (the first round at least).

    Args:
        seconds: T; ``None``: the first optimizer's time for its ``steps`` steps (it sets T for the others).

    Returns:
        per name: ``{"steps", "seconds" (training time after each round, cumulative), "eval_loss", "eval_acc" (after
        each round), "budget": {"seconds": T, "steps": steps within T, "used_s": their time, "eval_loss",
        "eval_acc"}, "model", "optimizer", "preconditioner", "state_bytes"}``.
    """
    train_set, test_set = data or digits()
    criterion = nn.CrossEntropyLoss()
    out = {}
    for name in names:
        lr, options = RECIPES[name]
        net = model()
        optimizer, pre = build_optimizer(name, net, lr, 0.9, 0.0, options)
        loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True)
        test_loader = DataLoader(test_set, batch_size=1000)
        record = {"steps": [], "seconds": [], "eval_loss": [], "eval_acc": []}
        clock, last, r = 0.0, 0.0, 0
        while r * round_steps < steps or seconds is not None and clock + last <= seconds:
            started = time.perf_counter()
            fit(net, loader, None, optimizer, epochs=r + 1, start_epoch=r, preconditioner=pre, max_steps=round_steps,
                printer=lambda line: None)
            last = time.perf_counter() - started
            clock += last
            r += 1
            loss, acc = evaluate(net, test_loader, single_strategy(net), criterion)
            record["steps"].append(r * round_steps)
            record["seconds"].append(clock)
            record["eval_loss"].append(loss)
            record["eval_acc"].append(acc)
        if seconds is None:
            seconds = record["seconds"][record["steps"].index(-(-steps // round_steps) * round_steps)]
        inside = max(1, sum(t <= seconds for t in record["seconds"]))  # rounds within T (the first at least)
        record["budget"] = {"seconds": seconds, "steps": record["steps"][inside - 1],
                            "used_s": record["seconds"][inside - 1], "eval_loss": record["eval_loss"][inside - 1],
                            "eval_acc": record["eval_acc"][inside - 1]}
        out[name] = dict(record, model=net, optimizer=optimizer, preconditioner=pre, state_bytes=state_bytes(optimizer))
    return out


def counted(record: dict, world_size: int) -> dict[str, int]:
    """What one of ``world_size`` data-parallel ranks holds and sends per step for this contender (counted from the
    shapes and the state, not timed):

    * ``state_bytes``: the optimizer's state on the rank that holds most — replicated for SGD and Adam; K-FAC's
      running factors A, G and their decompositions on every rank (``--kfac-broadcast decompositions``) plus its
      base SGD's momentum; Shampoo's, SOAP's and Muon's split by owner (:mod:`labkit.optim.split`);
    * ``comm_bytes``: payload per step — DDP's gradient all-reduce ``s·P`` for all; K-FAC adds its factors every
      ``factor_update_freq`` steps and decompositions every ``inv_update_freq``, averaged per step
      (:func:`labkit.optim.kfac.distributed.communication_per_step`); the split optimizers add the parameters'
      broadcast from their owners, ``s·P``.
    """
    optimizer, pre = record["optimizer"], record["preconditioner"]
    params = list(record["model"].parameters())
    grads = sum(p.numel() * p.element_size() for p in params) if world_size > 1 else 0
    if hasattr(optimizer, "split"):
        held = max(optimizer.split.state_bytes_per_rank(optimizer, world_size))
        return {"state_bytes": held, "comm_bytes": grads + optimizer.split.communication_per_step(world_size)}
    held = state_bytes(optimizer)
    if pre is None:
        return {"state_bytes": held, "comm_bytes": grads}
    factors = sum(t.numel() * t.element_size() for layer in pre.layers for t in (layer.A, layer.G))
    shapes = [(layer.d_in, layer.d_out) for layer in pre.layers]
    kfac = kfac_dist.communication_per_step(shapes, world_size, pre.method.value, pre.broadcast.value)
    per_step = kfac["factors"] / pre.factor_update_freq + kfac["decompositions"] / pre.inv_update_freq
    return {"state_bytes": held + factors + pre.decomposition_bytes(), "comm_bytes": grads + round(per_step)}

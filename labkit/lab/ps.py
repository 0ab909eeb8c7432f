"""Notebook 01b's experiment: the same model trained by a parameter server in sync, async and SSP mode.

    per_rank = labkit.dist.testing.run_ranks(compare_modes, 3, slow_worker="2:4")   # server 0, workers 1-2
    result = per_rank[0]    # {mode: {"history": [...], "updates": [...], "time_s": ...}}

Each mode runs through :func:`labkit.train.loop.fit` with :class:`~labkit.strategies.ps.strategy.ParameterServerStrategy`
from the same initial weights on the same data, evaluating after every epoch.
"""
from __future__ import annotations

import time

import torch

from labkit.data import datasets as kdata
from labkit.data import loader as loaders
from labkit.data.tensor import load_split
from labkit.dist.group import DistEnv
from labkit.models import cnn as kmodels
from labkit.optim import OptimizerSpec
from labkit.strategies.ps.strategy import ParameterServerStrategy
from labkit.train.loop import fit


def compare_modes(env: DistEnv, modes: tuple[str, ...] = ("sync", "async", "ssp"), *, epochs: int = 2,
                  train_size: int = 1024, test_size: int = 500, batch_size: int = 32, lr: float = 0.05,
                  momentum: float = 0.9,
                  max_staleness: int = 1, slow_worker: str | None = None, dataset: str = "mnist-sample",
                  model: str = "lenet") -> dict:
    """Train once per mode; every rank returns ``{mode: {"history", "updates", "time_s"}}``.

    ``history`` has fit's epoch records (test accuracy, ``time_s`` per epoch); ``updates`` the servers'
    per-update record (worker, clock, staleness, ahead, time_s).
    """
    info = kdata.dataset_info(dataset)
    # the splits held as tensors (the per-sample dataset's items, without importing torchvision on every rank)
    train = load_split("tensor", dataset, True, limit=train_size)
    test = load_split("tensor", dataset, False, limit=test_size)
    out = {}
    for mode in modes:
        options = {"ps_mode": mode, "ps_slow_worker": slow_worker, "ps_timeout_s": 120}
        if mode == "ssp":
            options["max_staleness"] = max_staleness
        strategy = ParameterServerStrategy(env, options)
        torch.manual_seed(0)
        net = strategy.prepare(kmodels.get_model(model, num_classes=info.num_classes, in_channels=info.in_channels,
                                                 image_size=info.image_size))
        # async/ssp servers take off the momentum asynchrony adds (labkit.strategies.ps.strategy)
        optimizer, _ = strategy.build_optimizer(net, OptimizerSpec("sgd", lr, momentum, env=env))
        train_loader = loaders.make_loader(train, batch_size, shuffle=True, sampler=strategy.sampler(train, True, 0),
                                         drop_last=True)
        test_loader = loaders.make_loader(test, 250, shuffle=False, sampler=strategy.sampler(test, False, 0))
        started = time.perf_counter()
        history = fit(net, train_loader, test_loader, optimizer, epochs=epochs, strategy=strategy,
                      printer=lambda *_: None)
        elapsed = time.perf_counter() - started
        record = strategy.records()
        out[mode] = {"history": history, "time_s": elapsed,
                     "updates": [u for server in record["per_server"] for u in server["updates"]]}
    return out

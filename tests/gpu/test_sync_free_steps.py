"""No host synchronisation inside a training step on a GPU (``pytest -m gpu``): with
``torch.cuda.set_sync_debug_mode("error")`` around every ``train_step`` and stop check after the two warm-up
steps, a single-device run and a DDP run (one NCCL rank, the stop check asking after every step) finish; a
``.item()``, a pageable copy or a ``.tolist()`` of a device tensor there would raise. Log steps, the throughput
window's ends and the epoch's end synchronise on purpose and stay outside."""
import pytest
import torch
from torch import nn

from labkit.data import loader as loaders
from labkit.data.tensor import TensorImages
from labkit.dist.group import distributed
from labkit.dist.testing import free_port
from labkit.optim import OptimizerSpec
from labkit.strategies import get_strategy
from labkit.train import loop as ktrain
from labkit.train.preempt import StopCheck, StopSignals

STEPS = 8


def _checked(fn, calls: list):
    """``fn`` with sync debug mode "error" from its third call on (the first two may build DDP's buckets)."""
    def run(*args, **kwargs):
        calls.append(None)
        torch.cuda.set_sync_debug_mode("error" if len(calls) > 2 else 0)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return run


@pytest.mark.parametrize("strategy_name", ["single", "ddp"])
def test_a_step_and_the_stop_check_never_wait_for_the_gpu(strategy_name, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if strategy_name == "ddp":
        for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
            monkeypatch.setenv(key, value)
    steps, checks = [], []
    monkeypatch.setattr(ktrain, "train_step", _checked(ktrain.train_step, steps))
    monkeypatch.setattr(StopCheck, "after_step", _checked(StopCheck.after_step, checks))
    with distributed("cuda") as env:
        g = torch.Generator().manual_seed(0)
        images = TensorImages(torch.randn(STEPS * 16, 1, 8, 8, generator=g).to(env.device),
                              torch.randint(0, 4, (STEPS * 16,), generator=g).to(env.device), (0.0,), (1.0,))
        strategy = get_strategy(strategy_name)(env, {})
        model = strategy.prepare(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4)))
        optimizer, _ = strategy.build_optimizer(model, OptimizerSpec("sgd", 0.05, 0.9, env=env))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        loader = loaders.make_loader(images, 16, shuffle=True, sampler=strategy.sampler(images, True, 0))
        history = ktrain.fit(model, loader, None, optimizer, epochs=1, strategy=strategy, scheduler=scheduler,
                             log_every=10 ** 6, printer=lambda line: None, stop=StopSignals(every_steps=1))
    assert len(steps) == STEPS and history[0]["timed_steps"] == STEPS - 2
    assert len(checks) == STEPS

"""Notebook 01b's second experiment: replicas that meet every H steps (local SGD, DiLoCo), and a checkpoint
resumed on another mesh.

    per_rank = labkit.dist.testing.run_ranks(compare_sync, 2, every=(1, 4, 16))
    result = per_rank[0]   # {"every-step": {...}, "local-sgd H=4": {...}, ...}: counted elements, losses

    run_ranks(save_and_resume, 2, "runs/reshard", save_on={"mesh": "tp=2"}, resume_on={"mesh": "dp=2"})
    resume_here("runs/reshard")                     # the same checkpoint in one process

Every run goes through :func:`labkit.train.loop.fit` with :class:`labkit.parallel.mesh.MeshStrategy` (``--mesh
dp=W --sync ...``), from the same initial weights on the same digits. The elements every all-reduce inside a
training step moves are counted by wrapping the call (:func:`counting`), not taken from a formula.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.data import datasets as kdata
from labkit.data import loader as loaders
from labkit.data.tensor import load_split
from labkit.dist.group import DistEnv
from labkit.models import cnn as kmodels
from labkit.optim import OptimizerSpec
from labkit.strategies.base import Strategy
from labkit.train import loop
from labkit.train.checkpoint import load_training_state, save_training_state


@contextlib.contextmanager
def counting(per_step: list[int]):
    """Within the block, every ``torch.distributed.all_reduce`` called inside a :func:`labkit.train.loop.train_step`
    adds its tensor's element count to that step's entry of ``per_step`` (one entry per step). A data-parallel step
    of replicas calls no other collective (``tests/test_step_collectives.py``); nor does a meeting of local SGD or
    DiLoCo."""
    all_reduce, step_fn, inside = dist.all_reduce, loop.train_step, [False]

    def counted(tensor, *args, **kwargs):
        if inside[0]:
            per_step[-1] += tensor.numel()
        return all_reduce(tensor, *args, **kwargs)

    def step(*args, **kwargs):
        per_step.append(0)
        inside[0] = True
        try:
            return step_fn(*args, **kwargs)
        finally:
            inside[0] = False

    dist.all_reduce, loop.train_step = counted, step
    try:
        yield per_step
    finally:
        dist.all_reduce, loop.train_step = all_reduce, step_fn


def _digits(train_size: int, test_size: int, dataset: str = "mnist-sample"):
    info = kdata.dataset_info(dataset)
    return info, load_split("tensor", dataset, True, limit=train_size), load_split("tensor", dataset, False,
                                                                                  limit=test_size)


def _model(info, name: str = "mlp", sequential: bool = False):
    """The model, seeded, as ``labkit train`` builds it: nested, or (``sequential``: for tp and pp) the flat
    ``nn.Sequential`` of its layers, whose tensors are named by layer (:func:`labkit.train.reshard.flat_names`)."""
    torch.manual_seed(0)
    return kmodels.get_model(name, num_classes=info.num_classes, in_channels=info.in_channels,
                             image_size=info.image_size, sequential=sequential)


def compare_sync(env: DistEnv, every: tuple[int, ...] = (1, 4, 16), syncs: tuple[str, ...] = ("local-sgd", "diloco"),
                 *, epochs: int = 2, train_size: int = 1024, test_size: int = 500, batch_size: int = 32,
                 lr: float = 0.05, momentum: float = 0.9, model: str = "mlp") -> dict:
    """Every-step data parallelism (``--allreduce native``: its all-reduce visible to Python), then each flavour of
    ``syncs`` at each H of ``every``, on ``W`` ranks (``--mesh dp=W``); every rank returns ``{name: {"elements":
    [per step], "history": fit's epoch records, "params": P}}``."""
    info, train, test = _digits(train_size, test_size)
    runs = {"every-step": {"allreduce": "native"}}
    runs.update({f"{sync} H={h}": {"sync": sync, "sync_every": h} for sync in syncs for h in every})
    out = {}
    from labkit.parallel.mesh import MeshStrategy

    for name, options in runs.items():
        strategy = MeshStrategy(env, {"mesh": f"dp={env.world_size}", **options})
        net = strategy.prepare(_model(info, model))
        optimizer, _ = strategy.build_optimizer(net, OptimizerSpec("sgd", lr, momentum, env=env))
        train_loader = loaders.make_loader(train, batch_size, shuffle=True, seed=0,
                                           sampler=strategy.sampler(train, True, 0), drop_last=True)
        test_loader = loaders.make_loader(test, 250, shuffle=False, sampler=strategy.sampler(test, False, 0))
        with counting([]) as per_step:
            history = loop.fit(net, train_loader, test_loader, optimizer, epochs=epochs, strategy=strategy,
                               printer=lambda *_: None)
        out[name] = {"elements": per_step, "history": history,
                     "params": sum(p.numel() for p in net.parameters())}
    return out


def _fit(strategy, net, optimizer, train, batch_size, steps, position=None) -> tuple[list, object]:
    """``steps`` steps of one epoch of fit (from ``position``, a mid-epoch checkpoint's); ``(the loss of each step
    on this rank (None where it does not own the loss), the constant LR schedule it stepped)``."""
    from labkit.dist.testing import record_losses

    losses = record_losses(strategy)
    dp = strategy.data_parallel_size
    loader = loaders.make_loader(train, batch_size // dp, shuffle=True, seed=0, drop_last=dp > 1,
                                 sampler=strategy.sampler(train, True, 0))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    loop.fit(net, loader, None, optimizer, epochs=1, strategy=strategy, scheduler=scheduler, total_steps=steps,
             position=position, printer=lambda *_: None)
    return [None if x is None else x.item() for x in losses], scheduler


def save_and_resume(env: DistEnv, out: str, save_on: dict, resume_on: dict, *, steps: int = 3,
                    train_size: int = 512, batch_size: int = 32, lr: float = 0.05, model: str = "mlp") -> dict:
    """``steps`` steps on the mesh ``save_on`` (e.g. ``{"mesh": "tp=2"}``), a checkpoint with that mid-epoch
    position in ``out``, one more step in memory; then that checkpoint resumed on the mesh ``resume_on`` for the
    one next step, and on rank 0 also by one process of its own (:func:`resume_here`, no process group: its
    first optimizer's imports are paid in the rank, not in the notebook's kernel). Every rank returns ``{"saved":
    losses, "resumed": losses, "saved owner", "resumed owner"}`` (losses of the ranks that own them; the global
    loss is the mean over the owners), rank 0 also ``"one process"``."""
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.loop import epoch_position

    info, train, _ = _digits(train_size, 10)
    result = {}
    for key, options in (("saved", save_on), ("resumed", resume_on)):
        strategy = MeshStrategy(env, options)
        strategy.check_model(model)
        net = strategy.prepare(_model(info, model, strategy.sequential_model))
        optimizer, _ = strategy.build_optimizer(net, OptimizerSpec("sgd", lr, 0.9, env=env))
        if key == "saved":
            losses, scheduler = _fit(strategy, net, optimizer, train, batch_size, steps)
            position = epoch_position(steps, torch.zeros(3, dtype=torch.float64), strategy)
            save_training_state(strategy.checkpoint_file(out), strategy, net, optimizer, scheduler, None,
                                {"epoch": 0, "position": position}, {"model": model})
            more, _ = _fit(strategy, net, optimizer, train, batch_size, steps + 1, position)
            result["saved"] = losses + more
        else:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
            state = load_training_state(strategy.checkpoint_file(out), strategy, net, optimizer, scheduler, None)
            result["resumed"], _ = _fit(strategy, net, optimizer, train, batch_size, steps + 1, state["position"])
        result[f"{key} owner"] = strategy.metric_owner()
    if env.rank == 0:
        result["one process"] = resume_here(out, steps=steps, train_size=train_size, batch_size=batch_size, lr=lr,
                                            model=model)
    return result


def resume_here(out: str | Path, *, steps: int = 3, train_size: int = 512, batch_size: int = 32, lr: float = 0.05,
                model: str = "mlp") -> float:
    """The checkpoint :func:`save_and_resume` wrote, resumed in this one process: the loss of its next step."""
    info, train, _ = _digits(train_size, 10)
    strategy = Strategy(DistEnv())
    net = _model(info, model)
    optimizer, _ = strategy.build_optimizer(net, OptimizerSpec("sgd", lr, 0.9))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = load_training_state(strategy.checkpoint_file(out), strategy, net, optimizer, scheduler, None)
    losses, _ = _fit(strategy, net, optimizer, train, batch_size, steps + 1, state["position"])
    return losses[-1]

"""The dp dimension's synchronisation flavours: replicas that meet every H steps instead of every step.

    torchrun --nproc_per_node 4 -m labkit train --strategy ddp --sync local-sgd --sync-every 8 --model mlp ...
    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --sync diloco --sync-every 16 --optimizer adam \\
        --outer-lr 0.7 --outer-momentum 0.9 --model gpt-tiny --dataset text-sample

``--sync every-step`` (default) is data parallelism as DDP does it: the gradients are averaged over the dp group
in every step (:mod:`labkit.parallel.dp`). The two others average nothing during the step; each replica steps the
run's optimizer on its own shard's gradient, and the replicas meet after every ``H``-th optimizer step
(``--sync-every H``), where ``P`` is the number of parameters a replica holds (its tp/pp part):

* ``local-sgd`` (Stich 2019; Lin et al. 2020, "Don't use large mini-batches, use local SGD"): the parameters are
  averaged, ``θ ← (1/d) Σ_r θ_r``: one all-reduce of ``P`` elements per ``H`` steps. Each replica keeps its own
  optimizer state (momentum, Adam's moments).
* ``diloco`` (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"): the
  run's optimizer is the *inner* one (AdamW in the paper). Every replica starts each round from the global
  parameters ``θ``; after ``H`` inner steps the pseudo-gradient ``Δ = θ − (1/d) Σ_r θ_r`` (one all-reduce of the
  ``Δ_r = θ − θ_r``, ``P`` elements) is handed to the *outer* optimizer, SGD with Nesterov momentum
  (``--outer-lr``, default 0.7, ``--outer-momentum``, default 0.9: the paper's), which steps ``θ``; every replica
  continues from the new ``θ``. ``--outer-momentum 0`` is plain SGD (Nesterov needs a momentum).

Bytes: every-step data parallelism all-reduces ``P`` gradient elements per step; both flavours all-reduce
``P`` elements per ``H`` steps, so a rank sends ``2(d − 1)/d · P · s / H`` bytes per step on a ring (``s``
bytes per element) — :func:`price`. The price is the loss: the replicas drift apart for ``H`` steps on their own
shards.

At ``H = 1``: local SGD with SGD (any momentum, weight decay) is every-step data parallelism — the average of the
replicas' steps is the step on the averaged gradient, since SGD's update is linear in the gradient, and the
average of the replicas' momentum buffers follows the averaged gradients. With Adam (not linear) it is not. DiLoCo
at ``H = 1`` with ``--outer-lr 1 --outer-momentum 0`` sets ``θ`` to the replicas' average: local SGD at ``H = 1``,
so with an SGD inner optimizer every-step data parallelism again; its defaults (0.7, Nesterov 0.9) are not.

Where the replicas differ (between two meetings) each rank's checkpoint holds its own replica; DiLoCo's also holds
``θ`` and the outer optimizer's momentum (:meth:`PeriodicSync.state_dict`).
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.dist import group as kdist
from labkit.errors import ConfigError

#: ``--sync`` values: the dp group's every-step gradient average (DDP), or a meeting every H steps
SYNCS = ("every-step", "local-sgd", "diloco")

#: ``labkit train`` flags of the dp dimension's synchronisation, plain data read without importing this module
#: (labkit.flags); shared by ``--mesh`` (labkit.parallel.dp) and ``--strategy ddp`` (labkit.parallel.ddp)
FLAGS = [
    {"flag": "--sync", "default": "every-step", "choices": ["every-step", "local-sgd", "diloco"],
     "help": "dp replicas: every-step = gradients averaged each step (DDP); local-sgd = each replica steps alone, "
             "parameters averaged every --sync-every steps; diloco = inner optimizer (the run's) for --sync-every "
             "steps, then an outer Nesterov SGD step on the averaged pseudo-gradient"},
    {"flag": "--sync-every", "type": "int", "range": "[1, 1000000]", "default": 8, "metavar": "H",
     "help": "--sync local-sgd|diloco: optimizer steps between two meetings of the replicas"},
    {"flag": "--outer-lr", "type": "float", "range": "(0, 10]", "default": 0.7,
     "help": "--sync diloco: the outer SGD's learning rate (paper: 0.7)"},
    {"flag": "--outer-momentum", "type": "float", "range": "[0, 1)", "default": 0.9,
     "help": "--sync diloco: the outer SGD's Nesterov momentum (paper: 0.9; 0: plain SGD)"},
]


def read_sync(options: dict) -> tuple[str, int, float, float]:
    """``(sync, every, outer_lr, outer_momentum)`` from the parsed options, defaults filled in.

    Raises:
        ConfigError: an unknown flavour, ``--sync-every`` below 1, or a DiLoCo flag without ``--sync diloco``
            that was changed from its default.
    """
    sync = options.get("sync") or "every-step"
    if sync not in SYNCS:
        raise ConfigError(f"unknown --sync {sync!r}; choose one of {', '.join(SYNCS)}")
    every = int(options.get("sync_every") or 8)
    if every < 1:
        raise ConfigError(f"--sync-every must be >= 1, got {every}")
    lr = float(options.get("outer_lr") if options.get("outer_lr") is not None else 0.7)
    momentum = float(options.get("outer_momentum") if options.get("outer_momentum") is not None else 0.9)
    if sync != "diloco" and (lr != 0.7 or momentum != 0.9):
        raise ConfigError(f"--outer-lr and --outer-momentum set DiLoCo's outer optimizer, but --sync is {sync}; "
                          "add --sync diloco or leave them out")
    return sync, every, lr, momentum


def price(param_bytes: float, size: int, every: int) -> dict[str, float]:
    """Bytes one rank sends per optimizer step over its dp group of ``d`` ranks, for ``P`` bytes of parameters,
    on a ring, when the replicas meet every ``H`` steps: one all-reduce of ``P`` bytes per meeting,

        ``2·(d − 1)/d·P / H``

    (``H = 1``: every-step data parallelism's gradient all-reduce; ``d = 1`` sends nothing)."""
    return {"bytes": 2 * (size - 1) / size * param_bytes / every if size > 1 else 0.0}


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


class PeriodicSync:
    """Local SGD: after every ``every``-th optimizer step, the replicas' parameters averaged over ``group`` (one
    all-reduce of one flat buffer of them all). Attached to the optimizer as a step post-hook, so the loop's step is
    the plain one.

    Attributes:
        steps: optimizer steps taken (saved with the checkpoint: the next meeting comes at the same step).
        meetings: how many times the replicas met (all-reduces issued).
    """

    def __init__(self, model: nn.Module, group, size: int, every: int):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.size, self.every = group, size, every
        self.steps, self.meetings = 0, 0

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Meet after ``optimizer``'s steps (``register_step_post_hook``: the loop calls ``optimizer.step()`` only)."""
        optimizer.register_step_post_hook(lambda *_: self.after_step())

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            with torch.no_grad():
                self.meet()
            self.meetings += 1

    def at_meeting(self) -> bool:
        """Are the replicas equal now (no step since the last meeting)?"""
        return self.steps % self.every == 0

    def meet(self) -> None:
        """``θ_r ← (1/d) Σ_r θ_r``."""
        flat = kdist.all_reduce(_flat(self.params), group=self.group) / self.size
        _unflatten_into(flat, self.params)

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])


class DiLoCo(PeriodicSync):
    """DiLoCo's outer loop: the global parameters ``θ`` (a copy) and their outer optimizer, SGD with Nesterov
    momentum; every ``every`` inner steps ``Δ = (1/d) Σ_r (θ − θ_r)`` is all-reduced, the outer optimizer steps
    ``θ`` on it, and every replica copies the new ``θ``."""

    def __init__(self, model: nn.Module, group, size: int, every: int, lr: float, momentum: float):
        super().__init__(model, group, size, every)
        self.theta = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.theta, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def meet(self) -> None:
        delta = kdist.all_reduce(_flat(self.theta) - _flat(self.params), group=self.group) / self.size
        for t in self.theta:
            t.grad = torch.empty_like(t)
        _unflatten_into(delta, [t.grad for t in self.theta])
        self.outer.step()
        for p, t in zip(self.params, self.theta, strict=True):
            p.copy_(t)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "theta": [t.clone() for t in self.theta], "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for t, saved in zip(self.theta, state["theta"], strict=True):
                t.copy_(saved)
        self.outer.load_state_dict(state["outer"])


def build(sync: str, model: nn.Module, group, size: int, every: int, lr: float, momentum: float) -> PeriodicSync:
    """The :class:`PeriodicSync` of flavour ``sync`` (``local-sgd`` or ``diloco``) over ``model``'s parameters."""
    if sync == "diloco":
        return DiLoCo(model, group, size, every, lr, momentum)
    return PeriodicSync(model, group, size, every)

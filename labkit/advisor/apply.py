"""Apply a plan: ``labkit.parallelize(model, plan)`` returns the model prepared for the plan's strategy and
the ``labkit train`` command that runs the same plan (the wrapper seed 000 asks for).

    par = labkit.parallelize("lenet", "auto", dataset="mnist-sample", ranks=2)
    par.command    # 'torchrun --nproc_per_node 2 -m labkit train --model lenet ... --strategy ddp ...'
    par.model      # inside a rank: the module to hand to labkit.train.fit with par.strategy

A plan on several ranks is prepared on every rank of a running process group (pass ``env``, e.g. the one
:func:`labkit.testing.run_ranks` or :func:`labkit.dist.distributed` gives).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from labkit.advisor.plan import Estimate, Plan
from labkit.dist import DistEnv
from labkit.errors import ConfigError
from labkit.strategies import Strategy, get_strategy


@dataclass
class Parallelized:
    """The prepared ``model``, its ``strategy`` (for :func:`labkit.train.fit`), the ``plan`` and its ``command``."""

    model: nn.Module
    strategy: Strategy
    plan: Plan
    command: str


def _plan(plan, model_name: str | None, dataset: str, ranks: int, batch_size: int) -> Plan:
    """``plan`` as a :class:`Plan`: given, an estimate's, read from a dict, or the advice's (``"auto"``: the best)."""
    if isinstance(plan, (Plan, Estimate, dict)):
        return Plan.from_dict(plan) if isinstance(plan, dict) else getattr(plan, "plan", plan)
    if not isinstance(plan, str):
        raise ConfigError(f"plan must be 'auto', a plan label, a Plan, an Estimate or a dict, got {type(plan).__name__}")
    if model_name is None:
        raise ConfigError("plan='auto' needs the model's name (model_name=...): the advisor profiles a kit model")
    from labkit.advisor.advise import advise

    advice = advise(model_name, dataset, ranks, batch_size)
    return advice.best.plan if plan == "auto" else advice.find(plan).plan


def parallelize(model: nn.Module | str, plan: Plan | Estimate | dict | str = "auto", *, model_name: str | None = None,
                dataset: str = "mnist-sample", ranks: int = 2, batch_size: int = 64, env: DistEnv | None = None,
                extra: tuple[str, ...] = ()) -> Parallelized:
    """Prepare ``model`` (a kit model name, or a module with a flat form) for ``plan``.

    Args:
        model: ``"lenet"`` etc. (built for ``dataset`` exactly as ``labkit train`` builds it), or an
            ``nn.Module`` (flattened with :func:`labkit.models.to_sequential` when the strategy cuts layers).
        plan: ``"auto"`` (advise and take the best), a plan label from the table, or a plan.
        model_name: the kit model name the command uses when ``model`` is a module.
        env: this process's place in the job (default: one process on the CPU).
        extra: more ``labkit train`` arguments for the command (``--epochs 5``, ...).

    Raises:
        ConfigError: unknown model, a model without a flat form, or ``env`` with the wrong number of ranks.
    """
    from labkit import data as kdata
    from labkit import models as kmodels

    name = model if isinstance(model, str) else model_name
    chosen = _plan(plan, name, dataset, ranks, batch_size)
    if name is None:
        raise ConfigError("give model_name=... (a kit model) so the returned command can build the same model")
    env = env or DistEnv()
    if env.world_size != chosen.processes:
        raise ConfigError(f"plan {chosen.label} runs on {chosen.processes} process(es) but this job has "
                          f"{env.world_size}; call parallelize on every rank of a {chosen.processes}-rank job")
    strategy = get_strategy(chosen.strategy)(env, chosen.option)
    if isinstance(model, str):
        info = kdata.dataset_info(dataset)
        module = kmodels.get_model(model, info.num_classes, info.in_channels, info.image_size,
                                   sequential=strategy.sequential_model)
    else:
        module = kmodels.to_sequential(model) if strategy.sequential_model else model
    return Parallelized(strategy.prepare(module), strategy, chosen, chosen.command(name, dataset, list(extra)))

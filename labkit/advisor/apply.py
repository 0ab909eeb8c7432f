"""Apply a plan: ``labkit.parallelize(model, plan)`` returns the model prepared for the plan's strategy and the
``labkit train`` command that runs the same plan (the wrapper seed 000 asks for)."""
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


def parallelize(model: nn.Module | str, plan: Plan | Estimate | dict | str = "auto", *, model_name: str | None = None,
                dataset: str = "mnist-sample", ranks: int = 2, batch_size: int = 64, env: DistEnv | None = None,
                extra: tuple[str, ...] = ()) -> Parallelized:
    """Prepare ``model`` (a kit model name, built for ``dataset`` as ``labkit train`` builds it; or an ``nn.Module``,
    flattened by :func:`labkit.models.to_sequential` when the strategy cuts layers, with ``model_name`` for the
    command) for ``plan``: ``"auto"`` (advise and take the best), a plan label from the table, or a plan. A plan
    on several ranks is prepared on every rank of a running process group: pass its ``env`` (default: one process
    on the CPU), e.g. :func:`labkit.testing.run_ranks`'s. ``extra``: more ``labkit train`` arguments for the
    command (``--epochs 5``, ...). Raises :class:`ConfigError` for an unknown model, a model without a flat form,
    or an ``env`` with the wrong number of ranks."""
    from labkit import data as kdata
    from labkit import models as kmodels

    name = model if isinstance(model, str) else model_name
    if name is None:
        raise ConfigError("give model_name=... (a kit model): the advisor profiles it and the command builds it")
    if isinstance(plan, str):
        from labkit.advisor.advise import advise

        advice = advise(name, dataset, ranks, batch_size)
        chosen = advice.best.plan if plan == "auto" else advice.find(plan).plan
    elif isinstance(plan, (Plan, Estimate, dict)):
        chosen = Plan.from_dict(plan) if isinstance(plan, dict) else getattr(plan, "plan", plan)
    else:
        raise ConfigError(f"plan must be 'auto', a plan label, a Plan, an Estimate or a dict, got {type(plan).__name__}")
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

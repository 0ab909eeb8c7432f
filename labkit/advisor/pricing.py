"""The registry of pricing functions: a strategy is searched when its module declares an ``ADVISOR`` literal.

The literal lives beside the strategy's ``FLAGS`` and is read without importing the module
(:func:`labkit.strategies.registered`)::

    ADVISOR = {"price": "labkit.advisor.cost:price_ddp", "plans": "spread", "batch": "split",
               "grid": {"allreduce": ["ddp", "ring"]}, "keep": "cheapest"}

``price`` names the pricing function, ``module:function`` with the signature ``(plan, profile, topology) ->
Estimate`` (its docstring holds the formula; it may live in the strategy's own module); the other keys say
which plans the search enumerates (:mod:`labkit.advisor.search`) and how a plan splits the batch
(:attr:`labkit.advisor.plan.Plan.data_parallel`).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from labkit.advisor.plan import Estimate, Plan
from labkit.advisor.profile import Profile
from labkit.advisor.topology import Topology
from labkit.errors import ConfigError


def advised() -> dict[str, dict]:
    """``{strategy: its ADVISOR literal}`` for every registered strategy that has one, in registry order."""
    from labkit.strategies import registered

    return registered("ADVISOR")


@functools.lru_cache(maxsize=None)
def _load(target: str) -> Callable:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def pricer(strategy: str) -> Callable[[Plan, Profile, Topology], Estimate]:
    """The pricing function strategy ``strategy``'s ``ADVISOR`` literal names."""
    from labkit.strategies import STRATEGIES, strategy_literal

    entry = strategy_literal(strategy, "ADVISOR") if strategy in STRATEGIES else None
    if entry is None or "price" not in entry:
        raise ConfigError(f"strategy {strategy!r} has no ADVISOR literal with a 'price' function; the advisor "
                          f"prices: {', '.join(advised())}")
    return _load(entry["price"])


def cpu_floor(plan: Plan, single: Profile | None, topo: Topology) -> float:
    """The shortest step a plan of ``q`` processes on ``c`` shared CPU cores can take: one process's step on
    the whole batch (compute, update, data, bookkeeping, from the one-process profile) over the cores it can
    use, ``step_single(B) / min(q, c)`` (0 off the CPU or without that profile). Work is conserved: ``q``
    ranks on ``c`` cores are never priced more than ``c`` times faster than one process, whatever the
    profiles at different thread counts say."""
    if single is None or topo.device != "cpu" or plan.processes <= 1:
        return 0.0
    B = plan.batch_size
    step = (single.time(B) + single.update_s_per_byte * single.param_bytes + single.data_s_per_sample * B
            + single.loop_s)
    return step / min(plan.processes, topo.cores)


def price(plan: Plan, prof: Profile, topo: Topology, single: Profile | None = None) -> Estimate:
    """The estimate of ``plan`` with ``prof`` measured at the plan's threads per process; on a CPU its step is
    at least :func:`cpu_floor` (``single``: the one-process profile; the compute term makes up any difference).
    Every plan also pays the training loop's own work per step, ``bookkeeping = loop_s`` (:class:`labkit.advisor.profile.Profile`,
    where measured). The loop's stop check is not priced: it is one tiny non-blocking all-reduce every few tenths
    of a second (:class:`labkit.preempt.StopCheck`), nothing measurable per step."""
    est = pricer(plan.strategy)(plan, prof, topo)
    if est.applicable:
        if prof.loop_s:
            est.time["bookkeeping"] = prof.loop_s  # host Python and tiny ops: not scaled with the device
        short = cpu_floor(plan, single, topo) - est.step_s
        if short > 0:  # the plan's profile promised more than the cores can do: compute pays the difference
            est.time["compute"] = est.time.get("compute", 0.0) + short
    est.limit_bytes = topo.memory_bytes
    return est

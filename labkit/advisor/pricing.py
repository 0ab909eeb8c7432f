"""The registry of pricing functions: a strategy is searched when its module declares an ``ADVISOR`` literal.

The literal lives beside the strategy's ``FLAGS`` and is read without importing the module
(:func:`labkit.strategies.registered`)::

    ADVISOR = {"price": "labkit.strategies.ddp:price_ddp", "plans": "spread", "batch": "split",
               "grid": {"allreduce": ["ddp", "ring"]}, "keep": "cheapest"}

``price`` names the pricing function, ``module:function`` with the signature ``(plan, profile, topology) ->
Estimate`` (its docstring holds the formula; it lives beside the strategy's ``FLAGS``); the other keys say
which plans the search enumerates (:mod:`labkit.advisor.search`) and how a plan splits the batch
(:attr:`labkit.advisor.plan.Plan.data_parallel`).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from labkit.advisor.alphabeta import cpu_floor
from labkit.advisor.plan import Estimate, Plan, Profile
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


def serial_step(prof: Profile, batch: int) -> float:
    """One process's step on ``batch`` samples with ``prof``: compute, update, data and bookkeeping."""
    return (prof.time(batch) + prof.update_s_per_byte * prof.param_bytes + prof.data_s_per_sample * batch
            + prof.loop_s)


def _price(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    est = pricer(plan.strategy)(plan, prof, topo)
    if est.applicable and prof.loop_s:
        est.time["bookkeeping"] = prof.loop_s  # host Python and tiny ops: not scaled with the device
    est.limit_bytes = topo.memory_bytes
    est.threads = prof.threads if topo.device == "cpu" else 0
    return est


def price(plan: Plan, prof: Profile, topo: Topology, serial: Profile | None = None) -> Estimate:
    """The estimate of ``plan`` with ``prof`` measured at the plan's threads per process. Every plan also pays
    the training loop's own work per step, ``bookkeeping = loop_s`` (:class:`labkit.advisor.profile.Profile`,
    where measured). The loop's stop check is not priced: it is one tiny non-blocking all-reduce every few tenths
    of a second (:class:`labkit.preempt.StopCheck`), nothing measurable per step.

    On a CPU, with ``serial`` (the profile at one thread per process), work is conserved both ways:

    * a plan of ``q > 1`` processes on ``c`` cores takes at least ``serial_step(B) / min(q, c)`` (the compute
      term makes up any difference): ``q`` ranks never do one thread's work more than ``c`` times faster;
    * a one-process plan is priced at the cheaper of its ``c``-thread and one-thread profiles: a process given
      more threads can do at least what it does on one (a profile at ``c`` threads taken while other programs
      hold the cores can be ten times slower than at one; that is the load, not the plan).

    So ``q`` ranks on ``c`` cores are never priced more than ``c`` times faster than one process."""
    est = _price(plan, prof, topo)
    if serial is None or topo.device != "cpu" or not est.applicable:
        return est
    if plan.processes == 1:
        alt = _price(plan, serial, topo) if serial is not prof else est
        return alt if alt.applicable and alt.step_s < est.step_s else est
    short = cpu_floor(serial_step(serial, plan.batch_size), plan.processes, topo.cores) - est.step_s
    if short > 0:
        est.time["compute"] = est.time.get("compute", 0.0) + short
    return est

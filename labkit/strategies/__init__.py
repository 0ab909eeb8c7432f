"""Ways to parallelise training, one per module; ``get_strategy(name)`` imports only the one asked for.

Adding a strategy: one module and one line in :data:`STRATEGIES`. The module holds a
:class:`~labkit.strategies.base.Strategy` subclass and, beside it, plain literals the rest of the kit reads
from its source without importing it (:func:`labkit.flags.read_literal`):

* ``FLAGS``: its ``labkit train`` flags (:mod:`labkit.flags`);
* ``ADVISOR``: how ``labkit advise`` searches and prices it (:mod:`labkit.advisor.search`; the pricing
  function it names holds the formula in its docstring);
* ``BENCH``: its run in ``labkit bench suite`` (:mod:`labkit.bench.suite`);
* ``BACKENDS``: the backend/device combinations it cannot run on (:mod:`labkit.backends`).

Each but ``FLAGS`` is optional: a strategy without ``ADVISOR`` is not searched, one without ``BENCH`` not in
the suite. This package imports no torch, so ``labkit train --help`` and flag errors answer without it.
"""
from __future__ import annotations

import importlib
import importlib.util

from labkit.errors import ConfigError
from labkit.flags import read_flags, read_literal
from labkit.parallel import available as dimensions_available
from labkit.parallel import dimension_flags

STRATEGIES: dict[str, str] = {
    "single": "labkit.strategies.base:Strategy",
    "ddp": "labkit.strategies.ddp:DDPStrategy",
    "model-parallel": "labkit.strategies.model_parallel:ModelParallelStrategy",
    "tensor-parallel": "labkit.strategies.tensor_parallel:TensorParallelStrategy",
    "hybrid": "labkit.strategies.hybrid:HybridStrategy",
    "gpipe": "labkit.strategies.gpipe:GPipeStrategy",
    "pipeline": "labkit.strategies.pipelining:PipelineStrategy",
    "zero": "labkit.strategies.zero:ZeroStrategy",
    "fsdp": "labkit.strategies.fsdp:FSDPStrategy",
    "ps": "labkit.strategies.ps:ParameterServerStrategy",
    "mesh": "labkit.strategies.mesh:MeshStrategy",
}


def _check(name: str) -> str:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def get_strategy(name: str):
    """The strategy class registered as ``name``.

    Raises:
        ConfigError: unknown name (the message lists the valid ones).
    """
    module, _, attr = _check(name).partition(":")
    return getattr(importlib.import_module(module), attr)


def strategy_flags(name: str) -> tuple[dict, ...]:
    """The ``labkit train`` flags of strategy ``name`` (its module's ``FLAGS``), read without importing it;
    ``mesh`` also brings every mesh dimension's flags (:mod:`labkit.parallel`)."""
    flags = read_flags(_check(name).partition(":")[0])
    if name == "mesh":
        flags += tuple(f for d in dimensions_available() for f in dimension_flags(d))
    return flags


def module_of(name: str) -> str:
    """The dotted module of strategy ``name``."""
    return _check(name).partition(":")[0]


def strategy_literal(name: str, literal: str, default=None):
    """The ``literal`` (``"ADVISOR"``, ``"BENCH"``, ``"BACKENDS"``...) of strategy ``name``'s module, read
    without importing it; ``default`` where the module has none."""
    return read_literal(module_of(name), literal, default)


def registered(literal: str) -> dict:
    """``{name: value}`` of every available strategy whose module declares ``literal``, in registry order: how
    the advisor and the benchmark suite find the strategies they know how to handle."""
    found = {}
    for name in available():
        value = strategy_literal(name, literal)
        if value is not None:
            found[name] = value
    return found


def available() -> list[str]:
    """Registered strategy names whose module is present in this installation."""
    return [n for n, target in STRATEGIES.items()
            if importlib.util.find_spec(target.partition(":")[0]) is not None]


def __getattr__(name: str):
    if name == "Strategy":  # the base class imports torch: only when asked for
        return importlib.import_module("labkit.strategies.base").Strategy
    raise AttributeError(f"module 'labkit.strategies' has no attribute {name!r}")


__all__ = ["Strategy", "STRATEGIES", "get_strategy", "strategy_flags", "available", "module_of", "strategy_literal",
           "registered"]

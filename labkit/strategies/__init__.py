"""Ways to parallelise training, one per module; ``get_strategy(name)`` imports only the one asked for.

Adding a strategy: one module and one line in :data:`STRATEGIES`. The module holds a
:class:`~labkit.strategies.base.Strategy` subclass and, beside it, plain literals the rest of the kit reads
from its source without importing it (:func:`labkit.flags.read_literal`):

* ``FLAGS``: its ``labkit train`` flags (:mod:`labkit.flags`); a flag another module declares is named in its
  ``SHARED_FLAGS`` literal instead (a preset and the mesh dimension it presets);
* ``ADVISOR``: how ``labkit advise`` searches and prices it (:mod:`labkit.advisor.search`; the pricing
  function it names holds the formula in its docstring);
* ``BENCH``: its run in ``labkit bench suite`` (:mod:`labkit.bench.suite`);
* ``BACKENDS``: the backend/device combinations it cannot run on (:mod:`labkit.strategies.backends`).

Each but ``FLAGS`` is optional: a strategy without ``ADVISOR`` is not searched, one without ``BENCH`` not in
the suite. This package imports no torch, so ``labkit train --help`` and flag errors answer without it.
"""
from __future__ import annotations

import importlib
import importlib.util

from labkit.errors import ConfigError
from labkit.flags import module_flags, read_literal, resolve
from labkit.parallel import available as dimensions_available
from labkit.parallel import dimension_flags

STRATEGIES: dict[str, str] = {
    "single": "labkit.strategies.base:Strategy",
    "ddp": "labkit.parallel.ddp:DDPStrategy",
    "model-parallel": "labkit.strategies.model_parallel:ModelParallelStrategy",
    "tensor-parallel": "labkit.parallel.tp_linear:TensorParallelStrategy",
    "hybrid": "labkit.strategies.hybrid:HybridStrategy",
    "gpipe": "labkit.strategies.gpipe:GPipeStrategy",
    "pipeline": "labkit.parallel.pipelining:PipelineStrategy",
    "zero": "labkit.parallel.zero:ZeroStrategy",
    "fsdp": "labkit.parallel.fsdp:FSDPStrategy",
    "ps": "labkit.strategies.ps.strategy:ParameterServerStrategy",
    "mesh": "labkit.parallel.mesh:MeshStrategy",
    "ft": "labkit.strategies.ft:FaultTolerantStrategy",
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
    return resolve(_check(name))


def strategy_flags(name: str) -> tuple[dict, ...]:
    """The ``labkit train`` flags of strategy ``name`` (its module's ``FLAGS`` and ``SHARED_FLAGS``), read without
    importing it; a strategy whose module says ``DIMENSION_FLAGS = True`` (the mesh, and ``ft``, whose replicas may
    be meshes) also brings every mesh dimension's flags (:mod:`labkit.parallel`)."""
    flags = module_flags(_check(name).partition(":")[0])
    if read_literal(module_of(name), "DIMENSION_FLAGS", False):
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


__all__ = ["STRATEGIES", "get_strategy", "strategy_flags", "available", "module_of", "strategy_literal",
           "registered"]

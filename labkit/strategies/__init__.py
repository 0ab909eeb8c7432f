"""Ways to parallelise training, one per module; ``get_strategy(name)`` imports only the one asked for.

Adding a strategy: one module (a :class:`~labkit.strategies.base.Strategy` subclass and its ``FLAGS``
literal, see :mod:`labkit.flags`) and one line in :data:`STRATEGIES`. This package imports no torch, so
``labkit train --help`` and flag errors answer without it.
"""
from __future__ import annotations

import importlib
import importlib.util

from labkit.errors import ConfigError
from labkit.flags import read_flags
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


def available() -> list[str]:
    """Registered strategy names whose module is present in this installation."""
    return [n for n, target in STRATEGIES.items()
            if importlib.util.find_spec(target.partition(":")[0]) is not None]


def __getattr__(name: str):
    if name == "Strategy":  # the base class imports torch: only when asked for
        return importlib.import_module("labkit.strategies.base").Strategy
    raise AttributeError(f"module 'labkit.strategies' has no attribute {name!r}")


__all__ = ["Strategy", "STRATEGIES", "get_strategy", "strategy_flags", "available"]

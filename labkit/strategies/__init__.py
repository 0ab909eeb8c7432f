"""Ways to parallelise training, one per module; ``get_strategy(name)`` imports only the one asked for."""
from __future__ import annotations

import importlib
import importlib.util

from labkit.errors import ConfigError
from labkit.strategies.base import Strategy

STRATEGIES: dict[str, str] = {
    "single": "labkit.strategies.base:Strategy",
    "ddp": "labkit.strategies.ddp:DDPStrategy",
    "model-parallel": "labkit.strategies.model_parallel:ModelParallelStrategy",
    "tensor-parallel": "labkit.strategies.tensor_parallel:TensorParallelStrategy",
    "hybrid": "labkit.strategies.hybrid:HybridStrategy",
    "gpipe": "labkit.strategies.gpipe:GPipeStrategy",
    "pipeline": "labkit.strategies.pipelining:PipelineStrategy",
    "ps": "labkit.strategies.ps:ParameterServerStrategy",
}


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``.

    Raises:
        ConfigError: unknown name (the message lists the valid ones).
    """
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    module, _, attr = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def available() -> list[str]:
    """Registered strategy names whose module is present in this installation."""
    return [n for n, target in STRATEGIES.items()
            if importlib.util.find_spec(target.partition(":")[0]) is not None]


__all__ = ["Strategy", "STRATEGIES", "get_strategy", "available"]

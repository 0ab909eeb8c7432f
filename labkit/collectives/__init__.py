"""All-reduce algorithms as schedules: simulated, executed over torch.distributed, animated, priced.

    from labkit.collectives import ALGORITHMS, all_reduce, get_schedule, simulate
    get_schedule("ring", 4).steps[0]      # who sends which chunk to whom in step 1
    simulate(get_schedule("tree", 5))     # apply it to 5 vectors in one process, check the sum
    all_reduce(grad, "ring")              # run it for real inside a process group

The schedules are plain data and load without torch; the simulator and executor load on first use, so
``labkit allreduce --help`` answers at once.
"""
from __future__ import annotations

import importlib
import sys
import types

# re-exported: the package's names (its __all__ below is computed, which the linter cannot read)
from labkit.collectives.parameter_server import parameter_server  # noqa: F401
from labkit.collectives.registry import ALGORITHMS, SCHEDULES, get_schedule, parse_algorithms  # noqa: F401
from labkit.collectives.schedule import Op, Schedule, ScheduleError, Step, Transfer, from_steps  # noqa: F401

_LAZY: dict[str, str] = {
    **dict.fromkeys(("StepRecord", "Trace", "all_reduce", "push_pull", "run_schedule", "traced_run"), "execute"),
    **dict.fromkeys(("Counts", "SimResult", "count", "coverage", "simulate"), "simulate"),
}

__all__ = sorted(["ALGORITHMS", "SCHEDULES", "Op", "Schedule", "ScheduleError", "Step", "Transfer", "from_steps",
                  "get_schedule", "parameter_server", "parse_algorithms", *_LAZY])


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Loading a submodule binds it on its package; `simulate` and `parameter_server` name both a module
        # and the function this package exports, and the function must win.
        if isinstance(value, types.ModuleType) and name in __all__:
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name in _LAZY:
            value = getattr(importlib.import_module(f"labkit.collectives.{_LAZY[name]}"), name)
            super().__setattr__(name, value)
            return value
        raise AttributeError(f"module 'labkit.collectives' has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(__all__))


sys.modules[__name__].__class__ = _Package

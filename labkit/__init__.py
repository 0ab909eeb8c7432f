"""labkit: a hands-on kit for distributed deep learning with PyTorch.

    import labkit
    labkit.train.run.run(labkit.train.run.TrainConfig(model="lenet", dataset="mnist-sample", epochs=1))

Packages, lowest first (docs/ARCHITECTURE.md): dist (process groups, the mesh's shape), data, models, collectives
(all-reduce schedules), launch (torchrun/sbatch from notebooks), parallel (every axis of ranks: dp, tp, pp, cp, ep),
strategies (what is not an axis of ranks), optim (K-FAC, LARS, LAMB), train (the one loop and a run), then advisor
(``labkit.parallelize(model, plan)``), lab, exercises, bench, faults, viz.
"""
from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

_SUBMODULES = ("advisor", "collectives", "data", "dist", "errors", "exercises", "lab", "launch", "models", "optim",
               "parallel", "results", "strategies", "train", "viz")


def quick() -> bool:
    """True when ``LABKIT_QUICK=1``: notebooks and jobs shrink to CPU-minutes on offline data."""
    return os.environ.get("LABKIT_QUICK", "0") not in ("", "0", "false", "False")


def __getattr__(name: str):
    # Importing labkit stays cheap; `labkit.train.loop` etc. load on first use.
    if name in _SUBMODULES:
        return importlib.import_module(f"labkit.{name}")
    if name == "parallelize":  # the advisor's wrapper: labkit.parallelize(model, plan="auto")
        return importlib.import_module("labkit.advisor.advise").parallelize
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")

"""labkit: a hands-on kit for distributed deep learning with PyTorch.

    import labkit
    labkit.train_run.run(labkit.train_run.TrainConfig(model="lenet", dataset="mnist-sample", epochs=1))

Modules: dist (process groups), data, models, train (the one loop), meters, results, strategies,
collectives (all-reduce schedules), viz, optim (K-FAC), launch (torchrun/sbatch from notebooks),
advisor (profile, price, search and validate strategies; ``labkit.parallelize(model, plan)``).
"""
from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

_SUBMODULES = ("advisor", "checks", "collectives", "data", "dist", "errors", "launch", "meters", "models", "optim",
               "results", "strategies", "testing", "train", "viz")


def quick() -> bool:
    """True when ``LABKIT_QUICK=1``: notebooks and jobs shrink to CPU-minutes on offline data."""
    return os.environ.get("LABKIT_QUICK", "0") not in ("", "0", "false", "False")


def __getattr__(name: str):
    # Importing labkit stays cheap; `labkit.train` etc. load on first use.
    if name in _SUBMODULES:
        return importlib.import_module(f"labkit.{name}")
    if name == "parallelize":  # the advisor's wrapper: labkit.parallelize(model, plan="auto")
        return importlib.import_module("labkit.advisor.advise").parallelize
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")

"""The strategy advisor: profile a model, price every strategy on a device topology, search, validate, apply.

    labkit advise --model alexnet_small --dataset synthetic-cifar10 --ranks 2 --validate
    model, command = labkit.parallelize("lenet", "auto", dataset="mnist-sample", ranks=2)

Importing this package is cheap (no torch); the parts load on first use.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "advise": "labkit.advisor.advise", "Advice": "labkit.advisor.advise",
    "Plan": "labkit.advisor.plan", "Estimate": "labkit.advisor.plan",
    "Topology": "labkit.advisor.topology", "Profile": "labkit.advisor.plan",
    "LayerProfile": "labkit.advisor.plan", "price": "labkit.advisor.search",
    "candidates": "labkit.advisor.search", "validate": "labkit.advisor.validate",
    "parallelize": "labkit.advisor.apply", "Parallelized": "labkit.advisor.apply",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'labkit.advisor' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)

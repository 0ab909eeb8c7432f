"""Dimensions of a device mesh, one per module; ``get_dimension(name)`` imports only the one asked for.

``labkit train --mesh dp=2,tp=2`` builds the mesh (:mod:`labkit.dist.mesh`) and one
:class:`~labkit.parallel.base.Dimension` per name, applied to the model in the order of :data:`DIMENSIONS`:
``tp`` shards the layers, ``cp`` / ``ep`` swap in ring attention / expert routing, ``pp`` cuts what is left
into stages, ``dp`` wraps each stage for data parallelism.

Adding a dimension: one module (a ``Dimension`` subclass and its ``FLAGS`` literal, see :mod:`labkit.flags`;
a flag another module declares is named in its ``SHARED_FLAGS`` literal instead of copied) and one line here. Beside ``FLAGS`` the module may declare an ``ADVISOR`` literal naming its pricing function
(``{"price": "labkit.parallel.dp:mesh_time"}``, a pure function of a :class:`labkit.parallel.pricing.MeshStep` with its
formula in the docstring), read like the
strategies' (:func:`dimension_literal`, :func:`registered`) for the advisor's mesh search. This package imports no torch, so flag and ``--mesh`` errors answer without it.
"""
from __future__ import annotations

import importlib
import importlib.util

from labkit.errors import ConfigError
from labkit.flags import module_flags, read_literal, resolve

#: name -> "module:Class", in APPLY order (tp first, dp last)
DIMENSIONS: dict[str, str] = {
    "tp": "labkit.parallel.tp:TensorParallel",
    "cp": "labkit.parallel.cp:ContextParallel",
    "ep": "labkit.parallel.ep:ExpertParallel",
    "pp": "labkit.parallel.pp:PipelineParallel",
    "dp": "labkit.parallel.dp:DataParallel",
}


def _check(name: str) -> str:
    if name not in DIMENSIONS:
        raise ConfigError(f"unknown mesh dimension {name!r}; choose one of: {', '.join(DIMENSIONS)}")
    return DIMENSIONS[name]


def installed(name: str) -> bool:
    """Is dimension ``name``'s module present in this installation?"""
    return importlib.util.find_spec(_check(name).partition(":")[0]) is not None


def get_dimension(name: str):
    """The :class:`~labkit.parallel.base.Dimension` subclass registered as ``name``.

    Raises:
        ConfigError: unknown name, or its module is not in this installation.
    """
    if not installed(name):
        raise ConfigError(f"mesh dimension {name!r} is not available in this version of labkit")
    return resolve(_check(name))


def dimension_flags(name: str) -> tuple[dict, ...]:
    """The ``labkit train`` flags of dimension ``name``: its module's ``FLAGS``, then those it shares with the
    module that declares them (its ``SHARED_FLAGS`` literal, ``{"module": ["--flag", ...]}``: one definition, the
    same choices and default in both places); empty if not installed."""
    return module_flags(_check(name).partition(":")[0]) if installed(name) else ()


def dimension_literal(name: str, literal: str, default=None):
    """The ``literal`` (e.g. ``"ADVISOR"``) of dimension ``name``'s module, read without importing it;
    ``default`` where the module has none or is not installed."""
    return read_literal(_check(name).partition(":")[0], literal, default) if installed(name) else default


def registered(literal: str) -> dict:
    """``{name: value}`` of every available dimension whose module declares ``literal``, in apply order."""
    found = {}
    for name in available():
        value = dimension_literal(name, literal)
        if value is not None:
            found[name] = value
    return found


def available() -> list[str]:
    """Registered dimension names whose module is present, in apply order."""
    return [n for n in DIMENSIONS if installed(n)]


__all__ = ["DIMENSIONS", "get_dimension", "dimension_flags", "available", "installed", "dimension_literal",
           "registered"]

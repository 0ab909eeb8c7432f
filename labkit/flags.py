"""Command-line flags as plain data, readable without importing the module that owns them.

A strategy module imports torch (about 2.5 s), but ``labkit train --help`` and a flag error must answer at
once. So each strategy declares its ``labkit train`` flags as a literal at the top of its own file::

    FLAGS = [
        {"flag": "--bucket-mb", "type": "float", "range": "(0, 1e6]", "default": 25.0, "help": "bucket size in MB"},
        {"flag": "--allreduce", "default": "ddp", "choices": ["ddp", "native", "ring"], "help": "..."},
    ]

and :func:`read_flags` reads that literal from the source with :mod:`ast`, without executing the file.
Keys: ``flag`` (required; a name without ``--`` is a positional argument), ``help`` (required),
``default``, ``type`` (``"int"``, ``"float"``, ``"str"``), ``range`` (required with ``"int"`` and ``"float"``:
the values allowed, in interval notation such as ``"[1, inf)"``, see :mod:`labkit.ranges`), ``choices``,
``nargs``, ``metavar``, ``action`` (``"store_true"``, ``"store_false"``), ``dest``, ``hidden`` (``True``: left
out of ``--help``, for flags the kit passes to its own sub-processes). The parsed value reaches the strategy
as ``options[dest]`` with ``dest`` = the flag without ``--``, dashes as underscores, unless the entry names
its ``dest``.
``labkit bench NAME`` builds its parsers the same way (:mod:`labkit.bench`).
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import pkgutil

from labkit.errors import ConfigError
from labkit.ranges import within

_KEYS = {"flag", "help", "default", "type", "range", "choices", "nargs", "metavar", "action", "dest", "hidden"}
_NUMBERS = ("int", "float")


@functools.cache
def resolve(spec: str):
    """The object a ``"module:attr"`` registry entry names, imported on first use and kept (every registry of the
    kit, strategies, dimensions, optimizers, checkers and prices, names its entries this way)."""
    return pkgutil.resolve_name(spec)


@functools.lru_cache(maxsize=None)
def _literals(module: str) -> dict[str, ast.expr]:
    """The module-level assignments of ``module`` (dotted name), parsed from its source, not executed."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.loader is None:
        raise ConfigError(f"module {module} is not installed")
    tree = ast.parse(spec.loader.get_source(module) or "", filename=spec.origin or module)
    out = {}
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        out.update((t.id, node.value) for t in targets if isinstance(t, ast.Name))
    return out


_MISSING = object()


def read_literal(module: str, name: str, default=None):
    """The value of the literal ``name = ...`` at the top level of ``module``, read without importing it
    (``default`` where the module has none). How the registries find a module's ``FLAGS``, ``ADVISOR``,
    ``BENCH`` and ``BACKENDS`` (:mod:`labkit.strategies`). The value is read once and shared: do not change it.

    Raises:
        ConfigError: the module is missing, or ``name`` is assigned something other than a literal.
    """
    value = _literal(module, name)
    return default if value is _MISSING else value


@functools.lru_cache(maxsize=None)
def _literal(module: str, name: str):
    node = _literals(module).get(name)
    if node is None:
        return _MISSING
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ConfigError(f"{module}.{name} must be a literal (plain lists, dicts, strings, numbers)") from None


@functools.lru_cache(maxsize=None)
def read_flags(module: str) -> tuple[dict, ...]:
    """The ``FLAGS`` literal of ``module`` (dotted name), read from its source without importing it.

    Returns:
        one dict per flag (empty when the module declares none).

    Raises:
        ConfigError: the module is missing, or its ``FLAGS`` is not a literal list of well-formed dicts.
    """
    flags = tuple(read_literal(module, "FLAGS", ()))
    for f in flags:
        if not isinstance(f, dict) or not {"flag", "help"} <= f.keys() or f.keys() - _KEYS:
            raise ConfigError(f"{module}.FLAGS: each entry needs 'flag' and 'help' and only {sorted(_KEYS)}"
                              f", got {f!r}")
        if (f.get("type") in _NUMBERS) != ("range" in f) or f.get("type", "str") not in (*_NUMBERS, "str"):
            raise ConfigError(f"{module}.FLAGS: {f['flag']}: a 'type' of {' or '.join(_NUMBERS)} needs a "
                              "'range' (e.g. '[1, inf)') and only those have one")
    return flags


def module_flags(module: str) -> tuple[dict, ...]:
    """The ``labkit train`` flags of ``module``: its ``FLAGS``, then those it shares with the module that declares
    them (its ``SHARED_FLAGS`` literal, ``{"module": ["--flag", ...]}``: one definition, the same choices and default
    in both places), read without importing either."""
    shared = read_literal(module, "SHARED_FLAGS", {})
    return read_flags(module) + tuple(f for owner, names in shared.items() for f in read_flags(owner)
                                      if f["flag"] in names)


def dest(flag: dict) -> str:
    """``--bucket-mb`` -> ``bucket_mb``: the key of the parsed value in the options dict."""
    return flag.get("dest") or flag["flag"].lstrip("-").replace("-", "_")


def _default(flag: dict):
    """The declared default, else what a switch means when absent (``store_false``: True)."""
    return flag.get("default", {"store_true": False, "store_false": True}.get(flag.get("action")))


def add_flags(group: argparse._ArgumentGroup, flags: tuple[dict, ...]) -> list[str]:
    """Add ``flags`` to an argparse group (or parser); return their ``dest`` names."""
    for f in flags:
        kwargs = {k: v for k, v in f.items() if k in ("choices", "nargs", "metavar", "action", "help")}
        kwargs["default"] = _default(f)
        if f.get("type") in _NUMBERS:
            kwargs["type"] = within(f["type"], f["range"])
        if f.get("hidden"):
            kwargs["help"] = argparse.SUPPRESS
        if f["flag"].startswith("-"):
            kwargs["dest"] = dest(f)
        group.add_argument(f["flag"], **kwargs)
    return [dest(f) for f in flags]


def defaults(flags: tuple[dict, ...]) -> dict:
    """``{dest: default}``: the options a strategy gets when built from Python without the CLI."""
    return {dest(f): _default(f) for f in flags}

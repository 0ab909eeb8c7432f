"""Command-line flags as plain data, readable without importing the module that owns them.

A strategy module imports torch (about 2.5 s), but ``labkit train --help`` and a flag error must answer at
once. So each strategy declares its ``labkit train`` flags as a literal at the top of its own file::

    FLAGS = [
        {"flag": "--bucket-mb", "type": "float", "default": 25.0, "help": "gradient bucket size in MB"},
        {"flag": "--allreduce", "default": "ddp", "choices": ["ddp", "native", "ring"], "help": "..."},
    ]

and :func:`read_flags` reads that literal from the source with :mod:`ast`, without executing the file.
Keys: ``flag`` (required), ``help`` (required), ``default``, ``type`` (``"int"``, ``"float"``, ``"str"``),
``choices``, ``nargs``, ``metavar``, ``action`` (``"store_true"``). The parsed value reaches the strategy
as ``options[dest]`` with ``dest`` = the flag without ``--``, dashes as underscores.
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib.util

from labkit.errors import ConfigError

_TYPES = {"int": int, "float": float, "str": str}
_KEYS = {"flag", "help", "default", "type", "choices", "nargs", "metavar", "action"}


@functools.lru_cache(maxsize=None)
def read_flags(module: str) -> tuple[dict, ...]:
    """The ``FLAGS`` literal of ``module`` (dotted name), read from its source without importing it.

    Returns:
        one dict per flag (empty when the module declares none).

    Raises:
        ConfigError: the module is missing, or its ``FLAGS`` is not a literal list of well-formed dicts.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.loader is None:
        raise ConfigError(f"module {module} is not installed")
    tree = ast.parse(spec.loader.get_source(module) or "", filename=spec.origin or module)
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "FLAGS" for t in targets):
            try:
                flags = tuple(ast.literal_eval(node.value))
            except ValueError:
                raise ConfigError(f"{module}.FLAGS must be a literal (plain lists, dicts, strings, numbers)") from None
            for f in flags:
                if not isinstance(f, dict) or not {"flag", "help"} <= f.keys() or f.keys() - _KEYS:
                    raise ConfigError(f"{module}.FLAGS: each entry needs 'flag' and 'help' and only {sorted(_KEYS)}"
                                      f", got {f!r}")
            return flags
    return ()


def dest(flag: dict) -> str:
    """``--bucket-mb`` -> ``bucket_mb``: the key of the parsed value in the options dict."""
    return flag["flag"].lstrip("-").replace("-", "_")


def add_flags(group: argparse._ArgumentGroup, flags: tuple[dict, ...]) -> list[str]:
    """Add ``flags`` to an argparse group; return their ``dest`` names."""
    for f in flags:
        kwargs = {k: v for k, v in f.items() if k in ("default", "choices", "nargs", "metavar", "action", "help")}
        if "type" in f:
            kwargs["type"] = _TYPES[f["type"]]
        kwargs.setdefault("default", False if f.get("action") == "store_true" else None)
        group.add_argument(f["flag"], dest=dest(f), **kwargs)
    return [dest(f) for f in flags]


def defaults(flags: tuple[dict, ...]) -> dict:
    """``{dest: default}``: the options a strategy gets when built from Python without the CLI."""
    return {dest(f): f.get("default", False if f.get("action") == "store_true" else None) for f in flags}

"""Workshop exercises with checkers: each module has a ``STARTER`` file, ``check(...)`` returning the
problems found (an empty list when the answer is right) and ``main(argv)`` for ``labkit check NAME``.

    labkit check training-step --init my_step.py      # write the starting file, then fill it in
    labkit check training-step my_step.py             # "correct: ..." or "not yet: ..." and exit 1
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Callable

from labkit.errors import ConfigError


def load_function(spec: str, default: str) -> Callable:
    """``"file.py"`` or ``"file.py:function"`` (default function ``default``) -> the function."""
    path, _, name = spec.partition(":")
    name = name or default
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no such file {path!r}; pass the Python file that defines {name}() "
                          f"(start one with --init {path})")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise ConfigError(f"{path} defines no function {name!r}; name it {default} or pass {path}:NAME")
    return getattr(module, name)


def report(problems: list[str], success: str) -> str:
    """The checker's verdict as printed: ``correct: ...`` or one ``not yet: ...`` line per problem."""
    return f"correct: {success}" if not problems else "\n".join(f"not yet: {p}" for p in problems)


def command(name: str, doc: str, default: str, check: Callable[[Callable], list[str]], success: str,
            argv: list[str]) -> int:
    """``labkit check NAME FILE[:FUNCTION]``: print the verdict; exit code 0 when right, 1 otherwise."""
    from labkit.cli import Parser

    parser = Parser(prog=f"labkit check {name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help=f"FILE.py[:FUNCTION] defining {default}()")
    args = parser.parse_args(argv)
    problems = check(load_function(args.file, default))
    print(report(problems, success))
    return 0 if not problems else 1

"""Workshop exercises with checkers: each module has a ``STARTER`` file, ``check(...)`` returning the
problems found (an empty list when the answer is right) and ``main(argv)`` for ``labkit check NAME``.

    labkit check training-step --init my_step.py      # write the starting file, then fill it in
    labkit check training-step my_step.py             # "correct: ..." or "not yet: ..." and exit 1
"""
from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable

from labkit.errors import ConfigError


def _syntax_error(file: Path, exc: SyntaxError) -> ConfigError:
    return ConfigError(f"{file}, line {exc.lineno}: {exc.msg}; fix it, then run the check again")


def parse_file(file: str | Path) -> None:
    """Refuse a learner's file that does not parse with one :class:`ConfigError` line naming the file and the line
    (for the checkers that run the file elsewhere, on ranks or as a script, rather than import it here)."""
    file = Path(file)
    try:
        compile(file.read_bytes(), str(file), "exec")
    except SyntaxError as exc:  # IndentationError included
        raise _syntax_error(file, exc) from None


def import_file(file: str | Path, module_name: str | None = None) -> ModuleType:
    """Import a learner's Python file; a file that does not parse, or raises while it is imported, is one
    :class:`ConfigError` line naming the file and the line (never a traceback through labkit)."""
    file = Path(file)
    module_spec = importlib.util.spec_from_file_location(module_name or file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as exc:  # IndentationError included: the learner's file, not labkit, is at fault
        raise _syntax_error(file, exc) from None
    except Exception as exc:  # code at the file's top level raised: name its line, not labkit's stack
        line = next((f.lineno for f in reversed(traceback.extract_tb(exc.__traceback__))
                     if Path(f.filename).resolve() == file.resolve()), "?")
        raise ConfigError(f"{file}, line {line}: importing it raised {type(exc).__name__}: {exc}") from None
    return module


def load_function(spec: str, default: str) -> Callable:
    """``"file.py"`` or ``"file.py:function"`` (default function ``default``) -> the function."""
    path, _, name = spec.partition(":")
    name = name or default
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no such file {path!r}; pass the Python file that defines {name}() "
                          f"(start one with --init {path})")
    module = import_file(file)
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

    parser = Parser(prog=f"labkit check {name}", description=doc)
    parser.add_argument("file", help=f"FILE.py[:FUNCTION] defining {default}()")
    args = parser.parse_args(argv)
    problems = check(load_function(args.file, default))
    print(report(problems, success))
    return 0 if not problems else 1

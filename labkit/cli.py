"""The ``labkit`` command. Each sub-command lives in its own module, imported only when used::

    labkit train --model lenet --dataset mnist-sample --epochs 2
    labkit tour
    labkit data fetch mnist cifar10
    labkit sample --out runs/gpt
    labkit allreduce verify --ranks 4 --algo all
    labkit bench single
    labkit check allreduce
    labkit advise --model lenet --ranks 2

Only the module of the sub-command named on the command line is imported (the others appear in the help
by their one-line summary), and no parser imports torch, so ``--help`` and argument errors answer at once.
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import os
import sys

from labkit.errors import LabkitError, OutputError, first_to_say, flag_error, report

#: command name -> (module that defines ``add_parser(subparsers)``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "tour": ("labkit.tour", "a short CPU tour of the kit (start here)"),
    "train": ("labkit.train.cli", "train a model with a parallel strategy"),
    "data": ("labkit.data.cli", "fetch datasets (on a login node) and list what is on disk"),
    "sample": ("labkit.sample", "print text from a trained language model's run"),
    "export": ("labkit.export", "write a run's checkpoint as one whole model file"),
    "allreduce": ("labkit.collectives.cli", "verify, animate and benchmark the all-reduce algorithms"),
    "bench": ("labkit.bench", "benchmarks (labkit vs plain PyTorch, scaling, sweeps)"),
    "check": ("labkit.exercises.cli", "check a workshop exercise"),
    "advise": ("labkit.advisor.cli", "recommend a parallelisation for a model and machine, and validate it"),
    "faults": ("labkit.faults.cli", "broken distributed programs to run, diagnose and fix"),
    "doctor": ("labkit.faults.doctor", "run any PyTorch script as a rank under the hang watchdog"),
}

_words: list[str] = []


def words() -> list[str]:
    """The words of the command line being parsed that are not options, e.g. ``["bench", "ddp"]``.

    A sub-command with sub-commands of its own uses it to import only the one named.
    """
    return list(_words)


@functools.lru_cache(maxsize=None)
def module_doc(module: str) -> str:
    """``module``'s docstring, read from its source without importing it ("" when it has none)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        return (ast.get_docstring(ast.parse(f.read())) or "").strip()


def summary_line(module: str) -> str:
    """First line of ``module``'s docstring, read from its source without importing it."""
    doc = module_doc(module)
    return doc.splitlines()[0] if doc else ""


class HelpFormatter(argparse.HelpFormatter):
    """labkit's help: a description of several lines (a module docstring: example commands, tables) keeps its
    lines, a one-line description is wrapped to the terminal, and reST's ````x```` shows as ```x```; every flag's
    help ends with its default, unless the help already says it or the flag is a switch (giving it says what it
    does; "(default: True)" beside ``--no-checkpoint`` would read backwards)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = text.replace("``", "`")
        if "\n" not in text.strip():
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").replace("``", "`")
        if ("default" in text or action.default is argparse.SUPPRESS or not action.option_strings
                or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """labkit's parsers (sub-commands' too, argparse makes them of their parent's class): a bad flag is one
    ``labkit: error: ...`` line, once per torchrun job, and exit code 2 (:func:`labkit.errors.flag_error`); the
    help is laid out by :class:`HelpFormatter`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        flag_error(message, f" (see {self.prog} --help)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``labkit`` parser, with the full parser of the sub-command that ``argv`` names."""
    _words[:] = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
    parser = Parser(prog="labkit", description="A hands-on kit for distributed deep learning.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_line) in COMMANDS.items():
        if _words[:1] != [name]:
            sub.add_parser(name, help=help_line)
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a sub-command; a :class:`LabkitError` becomes one ``labkit: error: ...`` line and exit code 2."""
    try:
        return _main(argv)
    except BrokenPipeError:  # `labkit data list | head -3`: the reader has what it wanted
        _silence_stdout()
        return 128 + 13  # what a shell reports for a writer stopped by SIGPIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except LabkitError as exc:
        return report(exc)
    except OSError as exc:  # a file or folder the user named (--out, a plot path) cannot be made or read
        if exc.filename is None:
            raise
        return report(OutputError(f"cannot use {exc.filename}: {exc.strerror}; choose another path"))
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of a torchrun job: one line for them all
        if first_to_say("labkit: interrupted"):
            print("labkit: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so that the interpreter's last flush does not complain."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a notebook, a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)

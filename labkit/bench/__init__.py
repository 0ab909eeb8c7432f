"""``labkit bench NAME``: benchmarks that measure labkit against a plain-PyTorch baseline in the same run.

Each benchmark writes its results in the labkit schema (records of kind "bench") and prints a table.
"""
from __future__ import annotations

import argparse
import functools
import importlib

from labkit.cli import HelpFormatter, module_doc, summary_line, words
from labkit.errors import ConfigError, flag_error
from labkit.flags import add_flags, read_flags

#: benchmark name -> module with a ``FLAGS`` literal (see :mod:`labkit.flags`) and ``main(args) -> int``
BENCHMARKS: dict[str, str] = {
    "single": "labkit.bench.single",
    "gpt": "labkit.bench.gpt",
    "ddp": "labkit.bench.ddp",
    "model-parallel": "labkit.bench.model_parallel",
    "gpipe": "labkit.bench.gpipe",
    "kfac": "labkit.bench.kfac",
    "zero": "labkit.bench.zero",
    "datapath": "labkit.bench.datapath",
    "largebatch": "labkit.bench.largebatch",
    "ps": "labkit.bench.ps",
    "tp": "labkit.bench.tp",
    "pp-schedules": "labkit.bench.pp_schedules",
    "suite": "labkit.bench.suite",
    "report": "labkit.bench.report",
}


class _Parser(argparse.ArgumentParser):
    """A benchmark's parser: a bad flag is one ``labkit: error: ...`` line and exit code 2, like labkit's errors."""

    def error(self, message: str):
        flag_error(message, f" (see {self.prog} --help)")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (labkit vs plain PyTorch, scaling, sweeps)", description=__doc__)
    names = p.add_subparsers(dest="bench", metavar="NAME", parser_class=_Parser)
    for name, module in BENCHMARKS.items():
        if words()[1:2] != [name]:  # only the benchmark asked for has its flags read
            names.add_parser(name, help=summary_line(module))
            continue
        _fill(names.add_parser(name, help=summary_line(module), description=module_doc(module),
                               formatter_class=HelpFormatter), name)
    p.set_defaults(func=lambda a: _missing(a))


def parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``labkit bench NAME`` alone, e.g. ``parser("gpipe").parse_args(["sweep", ...])``.

    Its ``func`` runs the benchmark: ``args = parser(name).parse_args(argv); args.func(args)``.
    """
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    return _fill(_Parser(prog=f"labkit bench {name}", description=module_doc(BENCHMARKS[name]),
                         formatter_class=HelpFormatter), name)


def _fill(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """Add the benchmark's flags (read from its source, torch stays unloaded) and the function that runs it."""
    add_flags(p, read_flags(BENCHMARKS[name]))
    p.set_defaults(func=functools.partial(_run, BENCHMARKS[name]))
    return p


def _run(module: str, args: argparse.Namespace) -> int:
    _check_names(args)
    return importlib.import_module(module).main(args)


def _check_names(args: argparse.Namespace) -> None:
    """An unknown ``--model``/``--models`` or ``--dataset`` is one line before the benchmark starts, so before it
    makes its results folder (a benchmark may refuse more, e.g. a CNN where it times a GPT)."""
    from labkit.data.datasets import check_dataset_name
    from labkit.models.cnn import check_model_name

    models = list(getattr(args, "models", None) or [])
    if getattr(args, "model", None) is not None:
        models.append(args.model)
    for name in models:
        check_model_name(name)
    if getattr(args, "dataset", None) is not None:
        check_dataset_name(args.dataset)


def _missing(args) -> int:
    raise ConfigError(f"name a benchmark: labkit bench {{{','.join(BENCHMARKS)}}}")

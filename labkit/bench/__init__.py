"""``labkit bench NAME``: benchmarks that measure labkit against a plain-PyTorch baseline in the same run.

Each benchmark writes its results in the labkit schema (records of kind "bench") and prints a table.
"""
from __future__ import annotations

import argparse
import importlib

from labkit.cli import summary_line, words
from labkit.errors import ConfigError

#: benchmark name -> module with ``add_arguments(parser)`` and ``main(args) -> int``
BENCHMARKS: dict[str, str] = {
    "single": "labkit.bench.single",
    "ddp": "labkit.bench.ddp",
    "model-parallel": "labkit.bench.model_parallel",
    "gpipe": "labkit.bench.gpipe",
    "kfac": "labkit.bench.kfac",
    "zero": "labkit.bench.zero",
    "datapath": "labkit.bench.datapath",
    "largebatch": "labkit.bench.largebatch",
    "ps": "labkit.bench.ps",
    "suite": "labkit.bench.suite",
    "report": "labkit.bench.report",
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (labkit vs plain PyTorch, scaling, sweeps)", description=__doc__)
    names = p.add_subparsers(dest="bench", metavar="NAME")
    for name, module in BENCHMARKS.items():
        if words()[1:2] != [name]:  # only the benchmark asked for is imported (they import torch)
            names.add_parser(name, help=summary_line(module))
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        bp = names.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0], description=mod.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.main)
    p.set_defaults(func=lambda a: _missing(a))


def _missing(args) -> int:
    raise ConfigError(f"name a benchmark: labkit bench {{{','.join(BENCHMARKS)}}}")

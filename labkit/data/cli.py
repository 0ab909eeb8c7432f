"""``labkit data fetch|list``: fetch datasets once on a machine with internet; list what is on disk.

The parser and ``list`` stay free of torch so they answer at once; :mod:`labkit.data.datasets` loads for ``fetch``.
"""
from __future__ import annotations

import argparse

#: the names of :data:`labkit.data.datasets.DATASETS` (a test keeps the two equal)
DATASET_NAMES = ("mnist", "cifar10", "mnist-sample", "synthetic-mnist", "synthetic-cifar10", "text-sample",
                 "tinyshakespeare", "tinyshakespeare-bpe")

#: what :func:`labkit.data.datasets.data_root` does when no folder is given
ROOT_HELP = ("dataset folder (default: $LABKIT_DATA if set, else the data/ folder of the labkit checkout "
             "when run from one, else ./data)")


def add_parser(subparsers) -> None:
    """Add ``labkit data fetch NAME... [--root DIR]`` and ``labkit data list [--root DIR]``."""
    parser = subparsers.add_parser("data", help="fetch datasets (on a login node) and list what is on disk",
                                   description="Fetch datasets once on a machine with internet; list them.")
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="{fetch,list}")
    p_fetch = sub.add_parser("fetch", help="download datasets with progress bars")
    p_fetch.add_argument("names", nargs="+", metavar="NAME", help=f"dataset names: {', '.join(DATASET_NAMES)}")
    p_list = sub.add_parser("list", help="show which datasets are available offline")
    for p in (p_fetch, p_list):
        p.add_argument("--root", default=None, help=ROOT_HELP)
    p_fetch.set_defaults(func=_fetch)
    p_list.set_defaults(func=_list)


def _fetch(args: argparse.Namespace) -> int:
    from labkit.data.datasets import fetch

    fetch(args.names, args.root)
    return 0


def _list(args: argparse.Namespace) -> int:
    from labkit.data.disk import check_folder, data_root, present

    base = data_root(args.root)
    check_folder(base)
    print(f"data root: {base}{'' if base.exists() else ' (no such folder yet: labkit data fetch makes it)'}")
    for name in DATASET_NAMES:
        print(f"  {name:<18} {present(name, base)}")
    return 0

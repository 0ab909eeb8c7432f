"""Is a downloaded dataset on disk, missing, or corrupt? ``labkit train`` and ``labkit data list`` ask the same
question here, so the list never calls "present" what training then refuses.

MNIST keeps its downloaded ``.gz`` archives next to the unpacked idx files; each archive is checked against
torchvision's MD5, each idx file by its header (magic ``0x0000 08 ndim``, big-endian sizes) and its length.
CIFAR10's pickled batches are checked against torchvision's MD5s.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

#: samples per MNIST idx file, by its prefix
_MNIST_COUNT = {"train": 60_000, "t10k": 10_000}
#: where torchvision puts each dataset's files under the data root (a test holds them to torchvision's own)
_FOLDERS = {"mnist": "MNIST/raw", "cifar10": "cifar-10-batches-py"}


@dataclass
class DataState:
    """``status`` is ``"ok"``, ``"missing"`` or ``"corrupt"``; ``path``/``reason`` name the first bad file."""

    status: str
    path: Path | None = None
    reason: str = ""


def verify(name: str, base: Path, train: bool | None = None) -> DataState:
    """Check the files of ``mnist`` or ``cifar10`` under ``base`` (one split, or both when ``train`` is None)."""
    folder = base / _FOLDERS[name]
    if not folder.is_dir():  # nothing fetched: torchvision's checksums (and torch with them) are not needed
        return DataState("missing", folder)
    checks = _mnist_files(base, train) if name == "mnist" else _cifar_files(base, train)
    missing = None
    for path, check in checks:
        if not path.exists():
            missing = missing or DataState("missing", path)
            continue
        reason = check(path)
        if reason:
            return DataState("corrupt", path, reason)
    return missing or DataState("ok")


def _wanted(prefix_is_train: bool, train: bool | None) -> bool:
    return train is None or prefix_is_train == train


def _mnist_files(base: Path, train: bool | None) -> list:
    from torchvision import datasets
    from torchvision.datasets.utils import check_integrity

    raw = base / "MNIST" / "raw"
    checks = []
    for archive, md5 in datasets.MNIST.resources:
        if not _wanted(archive.startswith("train"), train):
            continue
        unpacked = raw / archive.removesuffix(".gz")
        if (raw / archive).exists():  # torchvision keeps the archive: its MD5 is the strongest check
            checks.append((raw / archive, lambda p, md5=md5: "" if check_integrity(str(p), md5) else "MD5 mismatch"))
        checks.append((unpacked, _idx_reason))
    return checks


def _idx_reason(path: Path) -> str:
    """Why ``path`` is not a complete MNIST idx file ("" when it is)."""
    with open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4 or head[:2] != b"\0\0" or head[2] != 0x08 or head[3] not in (1, 3):
            return "not an idx file"
        dims = struct.unpack(f">{head[3]}I", f.read(4 * head[3]).ljust(4 * head[3], b"\0"))
    count = _MNIST_COUNT["train" if path.name.startswith("train") else "t10k"]
    expected = 4 + 4 * len(dims) + count * (784 if len(dims) == 3 else 1)
    if dims[0] != count or path.stat().st_size != expected:
        return f"{path.stat().st_size} bytes, expected {expected}"
    return ""


def _cifar_files(base: Path, train: bool | None) -> list:
    from torchvision import datasets
    from torchvision.datasets.utils import check_integrity

    cifar = datasets.CIFAR10
    entries = [*(cifar.train_list if _wanted(True, train) else []), *(cifar.test_list if _wanted(False, train) else []),
               [cifar.meta["filename"], cifar.meta["md5"]]]
    return [(base / cifar.base_folder / file, lambda p, md5=md5: "" if check_integrity(str(p), md5) else "MD5 mismatch")
            for file, md5 in entries]

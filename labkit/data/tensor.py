"""Datasets held as one tensor per split on the training device, with batched normalisation and augmentation.

    ds = tensor_dataset("mnist-sample", train=True, device="cpu")   # (4000, 1, 28, 28) uint8 + labels
    ds.batch(torch.arange(64))                                       # x: (64, 1, 28, 28) float32, normalised

All of the kit's datasets fit in memory (CIFAR10's 50,000 training images are 150 MB as uint8), so instead of
decoding and transforming one sample at a time in Python, a batch is one gather from the resident tensor,
then for the whole batch at once:

    x = (uint8 / 255 - mean) / std                     (per channel; what ToDtype(scale) + Normalize compute)
    x = pad(x, 4)[b, :, dy_b + i, dx_b + j]            (He et al. 2016 crop, dy_b, dx_b ~ U{0..8})
    j -> 31 - j for the half of the batch drawn to flip (horizontal flip, p = 1/2)

Crop and flip are one indexed gather. The random draws come from torch's global generator of the data's
device, which :func:`labkit.train.loop.fit` reseeds every epoch, so resumed runs see the same augmentation.

:class:`labkit.data.loader.TensorLoader` walks such a split in ``DataLoader``'s order.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Sampler, Subset

from labkit.data import datasets as kdata
from labkit.data import text as text_data
from labkit.errors import ConfigError

#: ``--loader`` choices: the resident-tensor path (default) and torchvision's per-sample DataLoader path
LOADERS = ("tensor", "torch")
PAD = 4  # CIFAR augmentation: zero padding before the random crop
#: a split whose float32 pixels fit in this many bytes is normalised once at load time (mnist-sample, MNIST);
#: larger ones (CIFAR10's training set: 614 MB) stay uint8 and are normalised per batch
FLOAT_BYTES = 256 * 2**20


class TensorImages(Dataset):
    """A split held as tensors: ``data`` (N, C, H, W) uint8 raw pixels or float32 already normalised, and
    ``targets`` (N,) int64, both on one device. uint8 pixels that fit :data:`FLOAT_BYTES` as float32 are
    normalised once here; larger splits keep uint8 (a quarter of the memory) and normalise each batch.

    Args:
        data, targets: the split.
        mean, std: per-channel normalisation applied to uint8 pixels after scaling them to [0, 1].
        augment: pad-4 random crop + horizontal flip for every batch.
    """

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...],
                 augment: bool = False):
        if data.ndim != 4 or len(targets) != len(data):
            raise ConfigError(f"tensor dataset needs data (N, C, H, W) and N targets, got {tuple(data.shape)} "
                              f"and {len(targets)}")
        self.targets, self.augment = targets.long(), augment
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=data.device).view(shape)
        self.std = torch.tensor(std, dtype=torch.float32, device=data.device).view(shape)
        small = data.numel() * 4 <= FLOAT_BYTES
        self.data = self._normalise(data) if small and not data.is_floating_point() else data

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 pixels -> float32 ``(x / 255 - mean) / std``, in the order ToDtype(scale) + Normalize use."""
        return x.to(torch.float32).mul_(1.0 / 255).sub_(self.mean).div_(self.std)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x, y = self.batch(torch.tensor([index], device=self.device))
        return x[0], int(y[0])

    def head(self, n: int | None) -> "TensorImages":
        """The first ``n`` samples (all if ``n`` is None or larger), sharing storage."""
        if n is None or n >= len(self):
            return self
        out = TensorImages.__new__(TensorImages)
        out.__dict__.update(self.__dict__, data=self.data[:n], targets=self.targets[:n])
        return out

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``index`` (B,) as ``(x (B, C, H, W) float32 normalised [and augmented], y (B,) int64)``."""
        x = self.data[index]
        if not x.is_floating_point():
            x = self._normalise(x)
        if self.augment:
            x = crop_flip(x, PAD)
        return x, self.targets[index]


def crop_flip(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Random ``pad``-pixel-padded crop and horizontal flip of every image of ``x`` (B, C, H, W), batched.

    Offsets ``dy, dx ~ U{0, ..., 2 pad}`` and the flip (p = 1/2) are drawn per image; the output pixel
    (i, j) is the padded pixel (dy + i, dx + j), or (dy + i, dx + W - 1 - j) when flipped.
    """
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))  # (B, C, H + 2 pad, W + 2 pad); 0 = the mean colour
    dy, dx = torch.randint(0, 2 * pad + 1, (2, b, 1), device=x.device)
    flip = torch.rand(b, 1, device=x.device) < 0.5
    i, j = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
    rows = dy + i  # (B, H)
    cols = dx + torch.where(flip, w - 1 - j, j)  # (B, W)
    out = padded[torch.arange(b, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()  # advanced indexing put C last: (B, H, W, C) -> (B, C, H, W)


def tensor_dataset(name: str, train: bool = True, root: str | os.PathLike | None = None, download: bool = False,
                   augment: bool = False, size: int | None = None,
                   device: torch.device | str = "cpu") -> TensorImages:
    """The split of ``name`` as a :class:`TensorImages` on ``device``; arguments as :func:`labkit.data.datasets.get_dataset`
    (and the same errors). Augmentation applies to the CIFAR10 training splits only."""
    data, targets = kdata.raw_split(name, train=train, root=root, download=download, size=size)
    info = kdata.dataset_info(name)
    if not isinstance(data, torch.Tensor):  # CIFAR10: numpy (N, H, W, C) uint8, list of labels
        data = torch.from_numpy(data).permute(0, 3, 1, 2)
    elif data.ndim == 3:  # MNIST: (N, H, W) uint8
        data = data.unsqueeze(1)
    augment = augment and train and name in ("cifar10", "synthetic-cifar10")
    return TensorImages(data.contiguous().to(device), torch.as_tensor(targets).to(device), info.mean, info.std,
                        augment)


def load_split(loader: str, name: str, train: bool, root: str | os.PathLike | None = None, download: bool = False,
               augment: bool = False, limit: int | None = None, device: torch.device | str = "cpu",
               seq_len: int | None = None) -> Dataset:
    """One split for ``--loader``: a resident :class:`TensorImages` on ``device`` (``tensor``) or torchvision's
    per-sample dataset (``torch``), cut to its first ``limit`` samples. A text dataset is a
    :class:`~labkit.data.text.TensorTokens` of ``seq_len``-token windows on ``device`` (``tensor``), or the same
    windows as a CPU ``TensorDataset`` that a DataLoader collates one by one (``torch``)."""
    if name in text_data.TEXT_NAMES:
        split = text_data.text_split(name, train, kdata.data_root(root), seq_len, limit,
                                     device=device if loader == "tensor" else "cpu")
        return split if loader == "tensor" else split.as_dataset()
    if loader == "tensor":
        return tensor_dataset(name, train, root, download, augment, device=device).head(limit)
    dataset = kdata.get_dataset(name, train=train, root=root, download=download, augment=augment)
    return dataset if limit is None or limit >= len(dataset) else Subset(dataset, range(limit))

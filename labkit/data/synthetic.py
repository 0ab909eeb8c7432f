"""The offline stand-ins ``synthetic-mnist`` and ``synthetic-cifar10``: seeded images around the real datasets'
statistics (:mod:`labkit.data.datasets` describes them), drawn in memory.

    x, y = synthetic_split("synthetic-mnist", DATASETS["synthetic-mnist"], train=True, size=None)   # 2,048
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

SYNTHETIC_NOISE = {"synthetic-mnist": 1.5, "synthetic-cifar10": 3.5}  # tuned: linear ~60-80 %, CNN higher
SYNTHETIC_SIZE = {True: 2048, False: 512}


def synthetic_split(name: str, info, train: bool, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The train (seed 1) or test (seed 2) split: ``size`` samples, default 2,048 train / 512 test."""
    n = SYNTHETIC_SIZE[train] if size is None else size
    return synthetic_images(name, info, n, seed=1 if train else 2)


class SyntheticImages(Dataset):
    """In-memory images ``data`` (N, C, H, W) float32 (already normalised) and labels ``targets`` (N,)."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, transform=None):
        self.data, self.targets, self.transform = data, targets, transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.data[index]
        return (self.transform(x) if self.transform else x), int(self.targets[index])


def synthetic_images(name: str, info, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (n, C, S, S) normalised, y (n,)) for a synthetic dataset of :class:`labkit.data.datasets.DatasetInfo` ``info``;
    templates are shared by both splits."""
    c, s = info.in_channels, info.image_size
    g = torch.Generator().manual_seed(0)
    # Smooth templates: 7x7 Gaussian fields upsampled; the channels share most of their pattern, as colour
    # channels of real images do.
    low = torch.randn(info.num_classes, 1, 7, 7, generator=g) + 0.4 * torch.randn(info.num_classes, c, 7, 7,
                                                                                   generator=g)
    templates = F.interpolate(low, size=(s, s), mode="bilinear", align_corners=False)
    templates = (templates - templates.mean()) / templates.std()
    g = torch.Generator().manual_seed(seed)
    y = torch.randperm(n, generator=g) % info.num_classes  # balanced classes, shuffled order
    dy, dx = torch.randint(-6, 7, (2, n, 1), generator=g)
    pixel = torch.arange(s)
    rows, cols = (pixel - dy) % s, (pixel - dx) % s  # (n, S): a cyclic shift, as torch.roll
    x = templates[y[:, None, None, None], torch.arange(c)[None, :, None, None], rows[:, None, :, None],
                  cols[:, None, None, :]]  # (n, C, S, S)
    noise = SYNTHETIC_NOISE[name]
    z = (x + noise * torch.randn(x.shape, generator=g)) / (1 + noise**2) ** 0.5  # unit variance
    mean, std = torch.tensor(info.mean).view(1, c, 1, 1), torch.tensor(info.std).view(1, c, 1, 1)
    pixels = (mean + std * z).clamp(0, 1)  # valid intensities around the real dataset's statistics
    return (pixels - mean) / std, y

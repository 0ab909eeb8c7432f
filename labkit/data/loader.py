"""Loaders whose order is reproducible: ``torch.utils.data.DataLoader`` for any dataset, :class:`TensorLoader` for
the resident splits, both reseeded per epoch so a resumed run sees the order a fresh one would.

    loader = make_loader(ds, batch_size=64, shuffle=True, seed=0)   # DataLoader, or TensorLoader for a resident split
    set_loader_epoch(loader, epoch, seed=0)                          # at the start of each epoch

:class:`TensorLoader` yields batches in exactly the order ``DataLoader`` would for the same seed, sampler and
``drop_last`` (with a sampler such as DistributedSampler it walks the sampler's indices), so switching between
``--loader tensor`` and ``--loader torch`` changes speed, not results.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit.data.tensor import TensorImages
from labkit.data.text import TensorTokens
from labkit.errors import ConfigError


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of ``epoch`` in a run seeded with ``seed``; distinct pairs differ while epoch < 100,003."""
    return seed * 100_003 + epoch


class TensorLoader:
    """Batches of a :class:`TensorImages` with the order semantics of ``DataLoader``.

    Args:
        dataset: the resident split.
        batch_size: samples per batch.
        shuffle: a fresh permutation every epoch, drawn from ``generator`` (ignored with a ``sampler``).
        sampler: e.g. ``DistributedSampler``: its indices, in its order (``set_epoch`` reshuffles it).
        seed: seeds ``generator``; :func:`set_loader_epoch` reseeds it per epoch.
        drop_last: drop the last incomplete batch.
    """

    def __init__(self, dataset: TensorImages, batch_size: int, shuffle: bool, sampler: Sampler | None = None,
                 seed: int = 0, drop_last: bool = False):
        if batch_size <= 0:
            raise ConfigError(f"batch size must be positive, got {batch_size}")
        self.dataset, self.batch_size, self.sampler, self.drop_last = dataset, batch_size, sampler, drop_last
        self.shuffle = shuffle and sampler is None
        self.generator = torch.Generator().manual_seed(epoch_seed(seed, 0))

    def __len__(self) -> int:
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self) -> torch.Tensor:
        """This epoch's sample indices (N,) on the data's device, as DataLoader would visit them."""
        if self.sampler is not None:
            index = torch.as_tensor(list(self.sampler), dtype=torch.int64)
        elif self.shuffle:
            # DataLoader draws one int64 (its workers' base seed) from the generator before RandomSampler's
            # permutation; drawing it too keeps both loaders on the same order for a seed.
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            index = torch.randperm(len(self.dataset), generator=self.generator)
        else:
            index = torch.arange(len(self.dataset))
        return index.to(self.dataset.device)

    def __iter__(self):
        index = self.order()
        for k in range(len(self)):
            yield self.dataset.batch(index[k * self.batch_size:(k + 1) * self.batch_size])


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool, sampler: Sampler | None = None, seed: int = 0,
                drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """A DataLoader whose order is reproducible: shuffling draws from ``loader.generator``.

    For a :class:`labkit.data.tensor.TensorImages` or :class:`labkit.data.text.TensorTokens` it is a
    :class:`~labkit.data.loader.TensorLoader`
    with the same order.

    With a ``sampler`` (e.g. DistributedSampler) the sampler decides the order and ``shuffle`` is ignored.
    Call :func:`set_loader_epoch` at the start of each epoch so epoch ``e`` has the same order in a fresh
    run and in a resumed one.

    Raises:
        ConfigError: ``batch_size`` <= 0 or ``num_workers`` < 0.
    """
    if batch_size <= 0:
        raise ConfigError(f"batch size must be positive, got {batch_size}")
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
    if isinstance(dataset, (TensorImages, TensorTokens)):  # resident: batches are gathered, no workers
        return TensorLoader(dataset, batch_size, shuffle, sampler, seed, drop_last)
    generator = torch.Generator().manual_seed(epoch_seed(seed, 0))
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
                      generator=generator, drop_last=drop_last, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0)


def set_loader_epoch(loader: DataLoader, epoch: int, seed: int = 0) -> None:
    """Reseed ``loader``'s shuffle with :func:`epoch_seed` and forward ``epoch`` to a sampler that has set_epoch."""
    if loader.generator is not None:
        loader.generator.manual_seed(epoch_seed(seed, epoch))
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)

"""Loaders whose order is reproducible: ``torch.utils.data.DataLoader`` for any dataset, :class:`TensorLoader` for
the resident splits, both reseeded per epoch so a resumed run sees the order a fresh one would.

    loader = make_loader(ds, batch_size=64, shuffle=True, seed=0)   # DataLoader, or TensorLoader for a resident split
    set_loader_epoch(loader, epoch, seed=0)                          # at the start of each epoch

One process shuffles with the sampler data parallelism uses, ``DistributedSampler`` with one replica: epoch
``e`` visits ``randperm(N)`` drawn from seed ``seed + e``, the permutation every rank of a data-parallel job draws
and deals out (rank ``r`` of ``W`` gets positions ``r, r + W, ...``). So step ``s`` of one process with a batch of
``W × b`` sees exactly the samples that the ``W`` ranks see together at their step ``s`` with ``b`` each (positions
``s·W·b ... (s+1)·W·b - 1`` of that permutation), every step of every shuffled epoch: data parallelism equals one
process over whole epochs, not only over their first step.

:class:`TensorLoader` yields batches in exactly the order ``DataLoader`` would for the same seed, sampler and
``drop_last`` (with a sampler such as DistributedSampler it walks the sampler's indices), so switching between
``--loader tensor`` and ``--loader torch`` changes speed, not results.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from labkit.data.tensor import TensorImages
from labkit.data.text import TensorTokens
from labkit.errors import ConfigError


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of a DataLoader's generator in ``epoch`` (its workers' base seeds); distinct pairs differ while
    epoch < 100,003. The shuffle itself is the sampler's (:func:`global_order`)."""
    return seed * 100_003 + epoch


def global_order(dataset: Dataset, seed: int, drop_last: bool = False) -> DistributedSampler:
    """The shuffle of one process: ``DistributedSampler`` with one replica (no process group needed), so its
    order per epoch (``set_epoch``) is the global order the ranks of a data-parallel job share."""
    return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=drop_last)


class TensorLoader:
    """Batches of a :class:`TensorImages` with the order semantics of ``DataLoader``.

    Args:
        dataset: the resident split.
        batch_size: samples per batch.
        shuffle: a fresh permutation every epoch, :func:`global_order`'s (ignored with a ``sampler``).
        sampler: e.g. ``DistributedSampler``: its indices, in its order (``set_epoch`` reshuffles it).
        seed: the shuffle's seed.
        drop_last: drop the last incomplete batch.
    """

    def __init__(self, dataset: TensorImages, batch_size: int, shuffle: bool, sampler: Sampler | None = None,
                 seed: int = 0, drop_last: bool = False):
        if batch_size <= 0:
            raise ConfigError(f"batch size must be positive, got {batch_size}")
        if shuffle and sampler is None:
            sampler = global_order(dataset, seed)
        self.dataset, self.batch_size, self.sampler, self.drop_last = dataset, batch_size, sampler, drop_last
        self.generator = None

    def __len__(self) -> int:
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self) -> torch.Tensor:
        """This epoch's sample indices (N,) on the data's device, as DataLoader would visit them."""
        if self.sampler is not None:
            index = torch.as_tensor(list(self.sampler), dtype=torch.int64)
        else:
            index = torch.arange(len(self.dataset))
        return index.to(self.dataset.device)

    def __iter__(self):
        index = self.order()
        for k in range(len(self)):
            yield self.dataset.batch(index[k * self.batch_size:(k + 1) * self.batch_size])


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool, sampler: Sampler | None = None, seed: int = 0,
                drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """A DataLoader whose order is reproducible: shuffling is :func:`global_order`'s.

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
    if shuffle and sampler is None:
        sampler = global_order(dataset, seed)
    generator = torch.Generator().manual_seed(epoch_seed(seed, 0))  # the workers' base seeds
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      generator=generator, drop_last=drop_last, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0)


def set_loader_epoch(loader: DataLoader, epoch: int, seed: int = 0) -> None:
    """Reseed ``loader``'s generator with :func:`epoch_seed` and forward ``epoch`` to its sampler (the shuffle)."""
    if loader.generator is not None:
        loader.generator.manual_seed(epoch_seed(seed, epoch))
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)

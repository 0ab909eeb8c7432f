"""Dropout under tensor parallelism: which random stream each dropout of a sharded GPT draws its mask from.

    rng = TensorParallelRNG(group)             # one per tensor-parallel group member
    with rng.fork(x.device):                   # this rank's own stream for a sharded activation
        y = F.dropout(x, p)
    y = F.dropout(x, p)                        # the default stream: a replicated activation

The rule (Megatron's "model-parallel RNG tracker", Shoeybi et al. 2019, §B):

* a dropout on an activation every tp rank holds whole — the residual and embedding dropouts of a block without
  sequence parallelism, on the (B, T, C) output of an all-reduce — must drop the SAME elements on every tp rank,
  or the replicas drift apart: it draws from the default stream, which :func:`labkit.train.loop.fit` seeds the same
  on the ranks of a tp group (``Strategy.seed_rank``: a rank's tp coordinate does not enter the seed);
* a dropout on a part of an activation — attention on a rank's own ``n_head/t`` heads, and with
  ``--sequence-parallel`` the residual and embedding dropouts on a rank's (B, T/t, C) slice of the sequence — must
  drop INDEPENDENT elements on each rank (different heads and tokens get independent masks, as they would in the
  single-process model): it draws from this rank's own stream.

The per-rank stream: at each sharded dropout the tracker draws one 62-bit integer ``d`` from the default CPU
stream (the same ``d`` on every tp rank: their default streams are equal) and seeds the generator of the
activation's device with

    ``s = d + OFFSET + r``        (``OFFSET = 2718``, as Megatron's; ``r`` the tp rank)

for the duration of the ``with`` block, then puts the default state back (``torch.random.fork_rng``'s idea, for
one generator): the default stream continues as if the sharded dropout had drawn nothing but ``d``, on every
rank alike. Since ``d`` comes from the default stream, the run seed, the epoch, the data-parallel and pipeline
coordinates and the step all enter ``s``, and a checkpoint that restores the default stream (a mid-epoch resume)
restores every sharded mask too: the tracker keeps no state of its own. Dimensions other than tp (dp, pp) seed
their default streams as before. Context parallelism refuses dropout (ring attention has none).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from labkit.parallel.mappings import group_rank

#: added to the drawn seed before the tp rank, so a sharded stream never restarts the default one
OFFSET = 2718


def _generator(device: torch.device) -> torch.Generator:
    """The default generator that masks on ``device`` are drawn from."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else
                                             torch.cuda.current_device()]
    return torch.default_generator


class TensorParallelRNG:
    """This rank's stream for dropouts on sharded activations (the module docstring's rule and formula)."""

    def __init__(self, group):
        self.rank = group_rank(group)

    def seed(self) -> int:
        """Draw ``d`` from the default CPU stream: ``d + OFFSET + tp rank``."""
        d = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        return d + OFFSET + self.rank

    @contextmanager
    def fork(self, device: torch.device):
        """Within the block, the generator of ``device`` is seeded with :meth:`seed`; restored after."""
        seed = self.seed()
        generator = _generator(torch.device(device))
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(saved)


class ShardDropout(torch.nn.Dropout):
    """``nn.Dropout`` on a tensor-parallel rank's own part of an activation (with sequence parallelism, its
    (B, T/t, C) slice of the sequence): the mask from :class:`TensorParallelRNG`'s stream."""

    def __init__(self, p: float, rng: TensorParallelRNG):
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.rng.fork(x.device):
            return super().forward(x)

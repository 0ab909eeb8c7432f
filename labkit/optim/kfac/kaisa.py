"""KAISA's grad-worker fraction (Pauloski et al., SC'21): how many ranks hold each layer's decomposition.

The W ranks are laid out as a grid of W/g *blocks* of g consecutive ranks (g = f·W *grad workers* per
layer, f the fraction) and g *columns* (rank r is in column r mod g). Layer ℓ's decomposition is
computed by its owner o_ℓ (:func:`labkit.optim.kfac.distributed.assign_owners`), then, per step:

1. on decomposition steps the owner broadcasts it to the g ranks of its block, the layer's grad workers;
2. every step, each grad worker preconditions ℓ's gradient and broadcasts the result down its column, to
   the W/g − 1 ranks of that column in the other blocks.

Every rank ends with every preconditioned gradient. ``f = 1/W`` (g = 1): only the owner holds the
decomposition and broadcasts the gradient to everyone (memory-optimal, ``--kfac-broadcast gradients``);
``f = 1`` (g = W): everyone holds every decomposition and nothing travels per step (communication-optimal,
``--kfac-broadcast decompositions``); in between, a hybrid. Payload bytes per rank for a layer with factor
sizes d_A (in), d_G (out) and ``s`` bytes per number::

    decompositions held (memory)    g/W of the layers (those owned in the rank's block): s(d_A² + d_A + d_G² + d_G)
                                    each (eigen) or s(d_A² + d_G²) (inverse)
    decomposition broadcast         a block of g ranks, on decomposition steps (g > 1)
    preconditioned gradients        a column of W/g ranks, every step (g < W): s d_A d_G
"""
from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch.distributed as dist

from labkit.errors import ConfigError
from labkit.optim.kfac import distributed as kfac_dist


def grad_workers(world_size: int, fraction: float, flag: str = "--kfac-grad-worker-fraction") -> int:
    """g = f·W, which must be a whole divisor of W (so the ranks form a grid of blocks and columns); ``flag`` names
    the fraction in the error (the split optimizers of :mod:`labkit.optim.split` take the same fraction)."""
    g = Fraction(fraction).limit_denominator(1_000) * world_size
    if not 0 < fraction <= 1 or g.denominator != 1 or world_size % int(g):
        divisors = [f"{d}/{world_size}" for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"{flag} {fraction:g} on {world_size} ranks: f·W must divide W; "
                          f"choose one of {', '.join(divisors)}")
    return int(g)


class GradWorkerLayout:
    """Blocks, columns and their process groups for ``g`` grad workers per layer.

    Args:
        world_size: W.
        g: grad workers per layer (a divisor of W).
        rank: this rank.
        groups: create the ``torch.distributed`` groups (collective: every rank must construct the layout).
    """

    def __init__(self, world_size: int, g: int, rank: int, groups: bool = True):
        self.world_size, self.g, self.rank = world_size, g, rank
        self.blocks = [list(range(b * g, (b + 1) * g)) for b in range(world_size // g)]
        self.columns = [list(range(c, world_size, g)) for c in range(g)]
        self.block_group = self.column_group = None
        if groups:
            # every rank creates every group, in the same order (new_group is collective)
            for ranks in self.blocks:
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.block_group = group
            for ranks in self.columns:
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.column_group = group

    def block_of(self, rank: int) -> int:
        return rank // self.g

    def holds(self, owner: int) -> bool:
        """Does this rank hold (and precondition with) the decomposition of a layer owned by ``owner``?"""
        return self.block_of(owner) == self.block_of(self.rank)

    def column_source(self, owner: int) -> int:
        """The grad worker of ``owner``'s layer that sends its preconditioned gradient down this rank's column."""
        return self.block_of(owner) * self.g + self.rank % self.g


def share_decompositions(layers: list, owners: Sequence[int], layout: GradWorkerLayout, method: str) -> int:
    """Step 1: owners broadcast to their block. Returns the payload bytes this rank took part in."""
    mine = [(l, o) for l, o in zip(layers, owners) if layout.holds(o)]
    if layout.g == 1 or not mine:
        return 0
    return kfac_dist.share_decompositions([l for l, _ in mine], [o for _, o in mine], layout.rank, method,
                                          group=layout.block_group)


def share_gradients(precond: list, owners: Sequence[int], layout: GradWorkerLayout) -> int:
    """Step 2: grad workers broadcast the preconditioned gradients down the columns (in place on receivers)."""
    if layout.g == layout.world_size:
        return 0
    sources = [layout.column_source(o) for o in owners]
    return kfac_dist.broadcast_from_owners([[p] for p in precond], sources, group=layout.column_group)


def decomposition_numel(d_in: int, d_out: int, method: str) -> int:
    return d_in ** 2 + d_in + d_out ** 2 + d_out if method == "eigen" else d_in ** 2 + d_out ** 2


def cost_per_rank(shapes: Sequence[tuple[int, int]], owners: Sequence[int], world_size: int, g: int, rank: int,
                  method: str, element_size: int = 4) -> dict[str, int]:
    """Bytes for ``rank``, from the layers' (d_in, d_out) and owners: the table of the module docstring.

    Returns:
        ``{"memory": decompositions held, "decompositions": broadcast payload on a decomposition step,
        "gradients": broadcast payload every step}``.
    """
    layout = GradWorkerLayout(world_size, g, rank, groups=False)
    held = [(s, o) for s, o in zip(shapes, owners) if layout.holds(o)]
    memory = sum(decomposition_numel(d_in, d_out, method) for (d_in, d_out), _ in held)
    if method == "inverse":  # the symmetric inverses travel as upper triangles
        sent = sum(kfac_dist.triu_numel(d_in) + kfac_dist.triu_numel(d_out) for (d_in, d_out), _ in held)
    else:
        sent = memory
    grads = sum(d_in * d_out for d_in, d_out in shapes) if g < world_size else 0
    return {"memory": memory * element_size, "decompositions": sent * element_size if g > 1 else 0,
            "gradients": grads * element_size}

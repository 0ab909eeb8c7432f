"""Distributed K-FAC under data parallelism: who computes which decomposition, and what travels.

Every rank holds the whole model and (after DDP's all-reduce) the same averaged gradient. On top of that:

1. **Factors** (every factor-update step): each rank's A_batch and G_batch are averaged with one
   all-reduce. Only the upper triangles travel (the factors are symmetric): d(d+1)/2 numbers each.
2. **Decompositions** (every inverse-update step): layer ℓ is decomposed by one rank only, its *owner*
   (:func:`assign_owners`), so the O(d³) work is split W ways.
3. Then one of two ways to share the result (Pauloski et al. 2021, KAISA):

   ``broadcast="decompositions"`` (the seed's design; communication-optimal)
       owners broadcast the eigendecompositions / inverses on inverse-update steps; every rank keeps all of
       them and preconditions every layer itself. Steps between updates communicate only the gradients,
       exactly as SGD does, so the extra traffic falls as the update interval grows.
   ``broadcast="gradients"`` (memory-optimal)
       owners keep their decompositions, precondition their layers' gradients and broadcast the
       preconditioned gradients *every* step: each rank stores 1/W of the decompositions but sends one
       more gradient's worth of data per step, whatever the update interval.

Per step, for factor sizes d_A, d_G and gradient sizes d_out × d_in summed over layers (payload bytes of
the collectives, ``s`` bytes per number; a ring all-reduce moves about 2(W-1)/W of its payload per rank)::

    gradients (DDP, every step)                 s Σ d_out d_in (+ other parameters)
    factors (factor steps)                      s Σ [d_A(d_A+1)/2 + d_G(d_G+1)/2]
    decompositions (inverse steps)   eigen      s Σ [d_A² + d_A + d_G² + d_G]
                                     inverse    s Σ [d_A(d_A+1)/2 + d_G(d_G+1)/2]
    preconditioned gradients (every step, "gradients" only)   s Σ d_out d_in
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from labkit.dist import group as kdist


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """Owner rank of each layer: largest first, each to the least-loaded rank (lowest rank on ties).

    With equal costs this is plain round-robin (layer i -> rank i mod W); with unequal costs it
    balances the O(d³) decomposition work (the "longest processing time first" rule).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0.0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def triu_numel(d: int) -> int:
    return d * (d + 1) // 2


def pack_symmetric(matrices: Sequence[Tensor]) -> Tensor:
    """Upper triangles of symmetric (d, d) matrices, concatenated: (Σ d(d+1)/2,)."""
    parts = []
    for m in matrices:
        rows, cols = torch.triu_indices(m.shape[0], m.shape[0], device=m.device)
        parts.append(m[rows, cols])
    return torch.cat(parts)


def unpack_symmetric(flat: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Inverse of :func:`pack_symmetric`: rebuild the full symmetric matrices."""
    out, offset = [], 0
    for d in sizes:
        rows, cols = torch.triu_indices(d, d, device=flat.device)
        m = flat.new_empty(d, d)
        values = flat[offset:offset + triu_numel(d)]
        m[rows, cols] = values
        m[cols, rows] = values
        out.append(m)
        offset += triu_numel(d)
    return out


def all_reduce_mean_symmetric(matrices: list[Tensor], group=None) -> tuple[list[Tensor], int]:
    """Average symmetric matrices over the ranks with one all-reduce of their upper triangles.

    Returns:
        (the averaged matrices, payload bytes).
    """
    flat = pack_symmetric(matrices)
    kdist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    return unpack_symmetric(flat, [m.shape[0] for m in matrices]), flat.numel() * flat.element_size()


def broadcast_from_owners(tensors: list[list[Tensor]], owners: Sequence[int], group=None) -> int:
    """Each layer's tensors travel from its owner to every rank, one broadcast per owner rank.

    Args:
        tensors: per layer, the tensors to share; on non-owners they are overwritten in place (they must
            already have the right shapes).
        owners: owner rank of each layer (global ranks of ``group``).

    Returns:
        payload bytes of the broadcasts.
    """
    sent = 0
    for src in sorted(set(owners)):
        mine = [t for layer, owner in zip(tensors, owners) if owner == src for t in layer]
        if not mine:
            continue
        flat = torch.cat([t.reshape(-1) for t in mine])
        kdist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in mine:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        sent += flat.numel() * flat.element_size()
    return sent


def share_decompositions(layers: list, owners: Sequence[int], rank: int, method: str, group=None) -> int:
    """Broadcast each layer's decomposition from its owner (``broadcast="decompositions"``).

    Non-owners allocate the tensors first (shapes from ``layer.decomposition_shapes``). The damped inverses
    are symmetric, so only their upper triangles travel. Returns the payload bytes.
    """
    shared = []
    for layer, owner in zip(layers, owners):
        shapes = layer.decomposition_shapes(method)
        if owner != rank:
            layer.decomposition = {k: layer.A.new_empty(s) for k, s in shapes.items()}
        if method == "inverse":
            shared.append([pack_symmetric([layer.decomposition["a_inv"], layer.decomposition["g_inv"]])])
        else:
            shared.append([layer.decomposition[k] for k in shapes])
    sent = broadcast_from_owners(shared, owners, group)
    if method == "inverse":
        for layer, (flat,) in zip(layers, shared):
            a_inv, g_inv = unpack_symmetric(flat, [layer.d_in, layer.d_out])
            layer.decomposition = {"a_inv": a_inv, "g_inv": g_inv}
    return sent


def communication_per_step(shapes: Sequence[tuple[int, int]], world_size: int, method: str, broadcast: str,
                           element_size: int = 4) -> dict[str, int]:
    """Payload bytes of K-FAC's own collectives per rank, from the layers' (d_in, d_out): the table above.

    Returns:
        ``{"factors": on each factor-update step, "decompositions": on each inverse-update step,
        "gradients": on every step}``; all 0 on one rank.
    """
    if world_size == 1:
        return {"factors": 0, "decompositions": 0, "gradients": 0}
    factors = sum(triu_numel(d_in) + triu_numel(d_out) for d_in, d_out in shapes)
    if broadcast == "gradients":
        return {"factors": factors * element_size, "decompositions": 0,
                "gradients": sum(d_in * d_out for d_in, d_out in shapes) * element_size}
    if method == "eigen":
        decompositions = sum(d_in ** 2 + d_in + d_out ** 2 + d_out for d_in, d_out in shapes)
    else:
        decompositions = factors
    return {"factors": factors * element_size, "decompositions": decompositions * element_size, "gradients": 0}

"""Tensor parallelism: slice fully-connected layers vertically, "the left half of each layer on one device,
the right half on the other" (Megatron-LM style column/row pairs).

A Linear computes ``Y = X W^T + b`` with ``X (B, i)``, ``W (o, i)``. Over ``p`` ranks:

* column-parallel: rank r holds rows ``W_r = W[r·o/p:(r+1)·o/p]`` (a slice of the *output* features) and
  computes ``Y_r = X W_r^T + b_r`` (B, o/p). Its input must be the full X on every rank.
* row-parallel: rank r holds columns ``W_r = W[:, r·i/p:(r+1)·i/p]`` (a slice of the *input* features),
  takes its slice ``X_r`` (B, i/p) and computes a partial ``X_r W_r^T`` (B, o); the sum over ranks is Y.

A column layer followed by a row layer needs no communication in between (the row layer wants exactly the
slice the column layer produced), so an MLP costs one all-reduce forward and one backward per pair. The layers
are the GPT's (:mod:`labkit.parallel.layers`), their operators those of :mod:`labkit.parallel.mappings`, the plan
over the pairs the ``tp`` mesh dimension's (:func:`labkit.parallel.tp.parallelize_linears`):

    launch:   torchrun --nproc_per_node 2 -m labkit train --strategy tensor-parallel --model mlp
    the same: torchrun --nproc_per_node 2 -m labkit train --mesh tp=2 --model mlp

This module holds the preset (:class:`TensorParallelStrategy`), seed 000's bytes of one FC layer
(:func:`fc_layer_bytes`, :func:`measure_fc_bytes`) and the advisor's price (:func:`price_tensor_parallel`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import allreduce_time, common_terms, compute_scale, memory_terms
from labkit.parallel.layers import ColumnParallelLinear
from labkit.parallel.mappings import all_reduce_copy, count_bytes
from labkit.parallel.mesh import MeshStrategy

__all__ = [
    "TensorParallelStrategy",
    "fc_layer_bytes",
    "measure_fc_bytes",
]

#: ``labkit advise`` (labkit.advisor.search) and ``labkit bench suite`` (ranks, extra flags)
ADVISOR = {"price": "labkit.parallel.tp_linear:price_tensor_parallel", "plans": "spread"}
BENCH = {"ranks": 2, "flags": []}


def fc_layer_bytes(batch: int, in_features: int, out_features: int, world_size: int,
                   bytes_per_value: int = 4) -> dict[str, float]:
    """Seed 000's comparison for one FC layer ``Y = X W^T + b`` (X (B, i), W (o, i)) per training step,
    p = ``world_size``: what does it cost to split the batch (dim 0) versus the features (dim 1)?

    * data parallel (split the batch, dim 0): all-reduce the gradient, ``o·i + o`` values per rank;
      ring wire bytes per rank ``2(p-1)/p · (o·i + o)``.
    * model parallel (split the features, dim 1, column-parallel + gather): forward all-gather of Y
      (each rank's shard ``B·o/p``, wire ``(p-1)·B·o/p``), backward all-reduce of dX (``B·i``, wire
      ``2(p-1)/p · B·i``).

    Data parallel moves parameters; model parallel moves activations: FC layers (many weights, small
    activations) favour model parallel, convolutions (few weights, big activations) data parallel.
    :func:`measure_fc_bytes` counts a real step.
    """
    p, s = world_size, bytes_per_value
    dp_payload = (out_features * in_features + out_features) * s
    mp_gather, mp_reduce = batch * out_features // p * s, batch * in_features * s
    return {"data_parallel_payload": dp_payload, "data_parallel_wire": 2 * (p - 1) / p * dp_payload,
            "model_parallel_payload": mp_gather + mp_reduce,
            "model_parallel_wire": (p - 1) * mp_gather + 2 * (p - 1) / p * mp_reduce}


def measure_fc_bytes(env, batch: int, in_features: int, out_features: int) -> dict[str, float]:
    """Run one training step of one FC layer both ways on this job's ranks; count the collectives' bytes.

    Data parallel: rank r takes rows ``r·B/p ..`` of the batch through the whole layer, then all-reduces
    the gradients. Model parallel: every rank takes the whole batch through its column slice, all-gathers
    Y, and (backward) all-reduces dX. Call on every rank, e.g. ``run_ranks(measure_fc_bytes, 2, 32, 2048, 512)``.

    Returns:
        payload and ring wire bytes per rank for each way; compare with :func:`fc_layer_bytes`.
    """
    p = env.world_size
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features).to(env.device)
    x = torch.randn(batch, in_features, device=env.device)  # (B, i), the same on every rank
    with count_bytes() as dp:
        F.linear(x.chunk(p)[env.rank], dense.weight, dense.bias).sum().backward()  # (B/p, o)
        for param in dense.parameters():
            all_reduce_copy(param.grad, where="gradient")
    column = ColumnParallelLinear(dense, enter=True, gather_output=True)
    with count_bytes() as mp:
        column(x.clone().requires_grad_()).sum().backward()  # a hidden layer: dX flows on to the layer below
    return {"data_parallel_payload": dp.total(), "data_parallel_wire": dp.ring_wire_bytes(p),
            "model_parallel_payload": mp.total(), "model_parallel_wire": mp.ring_wire_bytes(p)}


class TensorParallelStrategy(MeshStrategy):
    """``--strategy tensor-parallel``: a preset of ``--mesh tp=N`` over every rank of the job.

    Every rank sees the whole batch and holds a slice of each FC pair (``--model mlp``, the ``tp`` dimension's plan
    over ``Linear`` pairs, :func:`labkit.parallel.tp.parallelize_linears`); a GPT is split as ``--mesh tp=N`` splits
    it. Outputs are identical on every rank, so only rank 0 counts metrics; each rank checkpoints its own slices to
    ``checkpoint.rank{r}.pt``.
    """

    name = "tensor-parallel"

    def __init__(self, env, options=None):
        super().__init__(env, {**(options or {}), "mesh": f"tp={env.world_size}"})
        # a flat nn.Sequential until check_model says otherwise (a GPT), for callers that build the model without it
        self.sequential_model = True


def price_tensor_parallel(plan, prof, topo) -> Estimate:
    """Column/row pairs of Linears sliced over ``p`` ranks; every rank runs the whole batch ``B``.

    Sliced layers ``S`` (each pair and the elementwise layers between) cost ``T_k(B/p)``, the rest
    ``T_k(B)``: ``compute = s·(T_rest(B) + Σ_{k∈S} T_k(B/p))``. Per pair (column i, row j):
    ``communication = AR(B·A_{i−1}, native, p)`` (backward, input gradient) ``+ AR(B·A_j, native, p)``
    (forward, partial sums). Memory ``3·P_dev + M_rest(B) + M_S(B)/p`` with
    ``P_dev = P − (1 − 1/p)·P_S``.
    """
    p, B = plan.processes, plan.batch_size
    if not prof.tp_pairs:
        return Estimate(plan, note="no Linear → activation → Linear pair to slice")
    if any(h % p for h in prof.tp_hidden):
        return Estimate(plan, note=f"hidden sizes {prof.tp_hidden} not divisible by {p}")
    sliced = {k for i, j in prof.tp_pairs for k in range(i, j + 1)}
    rest = [k for k in range(len(prof.layers)) if k not in sliced]
    compute = sum(prof.layers[k].time(B) for k in rest) + sum(prof.layers[k].time(B / p) for k in sliced)
    inputs = [prof.layers[i - 1].out_bytes if i else prof.input_bytes for i, _ in prof.tp_pairs]
    comm = sum(allreduce_time(B * a, p, "native", topo) + allreduce_time(B * prof.layers[j].out_bytes, p, "native",
                                                                          topo)
               for a, (_, j) in zip(inputs, prof.tp_pairs))
    p_sliced = sum(prof.layers[k].param_bytes for k in sliced)
    p_dev = prof.param_bytes - (1 - 1 / p) * p_sliced
    time = {"compute": compute_scale(topo, p, prof) * compute, "communication": comm, **common_terms(prof, topo, p_dev, B)}
    acts = sum(prof.layers[k].saved_bytes for k in rest) * B + sum(prof.layers[k].saved_bytes for k in sliced) * B / p
    return Estimate(plan, time, memory_terms(prof, topo, p_dev, acts))

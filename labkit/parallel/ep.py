"""Expert parallelism (``--mesh ep=N``): a mixture of experts' E experts spread over N ranks, E/N on each.

    torchrun --nproc_per_node 2 -m labkit train --mesh ep=2 --model gpt-moe-tiny --dataset text-sample

The ``ep`` ranks see different sequences (ep shards the batch as dp does: ``data_parallel_size`` = N) and hold
the same non-expert weights. In every :class:`labkit.models.moe.MoE` layer a rank routes its own tokens, then
(:class:`AllToAllExchange`):

1. counts first: an ``all_to_all_single`` of the (E,) numbers of rows this rank sends to each expert, so every
   rank learns how many rows it receives from each rank for each of its experts (the splits are uneven);
2. dispatch: the rows, sorted by expert, in one ``all_to_all_single`` with those splits;
3. the rank's experts run on the rows they received;
4. combine: the outputs go back the same way (the splits swapped), and the sender sums them with its gates.

Backward runs the two exchanges in reverse (:class:`labkit.parallel.mappings.AllToAll`). The split sizes come to the
host (a sync, as in any uneven all-to-all; the single-process MoE syncs too, to find each expert's rows).

Gradients (:meth:`ExpertParallel.sync_gradients`) so that a step equals single-process ``fit`` on the global
batch with the same routing (same routing: groups are sequences, :mod:`labkit.models.moe`): non-expert gradients are
averaged over the ep group (one all-reduce of them all flattened); an expert's gradient already sums the
gradients of the mean losses of all N ranks (their rows came to it), so it is divided by N.

All-to-all bytes a rank sends to other ranks per step, per MoE layer (:meth:`ExpertParallel.price`)::

    activations: 2 · (R_out + R_in) · C · b    R_out: rows it dispatches to other ranks, R_in: rows it gets
                                               (dispatch + combine forward, both again in backward)
    counts:      E · (N − 1) / N · 8           (int64, forward only)

With n tokens per rank, top-k, routing spread evenly and nothing dropped, R_out = R_in = n k (N − 1) / N:
``4 n k C b (N − 1) / N``. A dense GPT of the same compute per token (one MLP k times as wide) trained with data
parallelism over the same N ranks instead all-reduces its P parameters: ``2 (N − 1) / N · P · b`` (ring).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from labkit.dist import group as kdist
from labkit.errors import ConfigError
from labkit.models.moe import MOE_SIZES, MoE, moe_layers, run_experts
from labkit.parallel.base import Dimension
from labkit.parallel.mappings import AllToAll

FLAGS: list = []
#: ``labkit advise --model gpt-moe-*``'s mesh search (labkit.parallel.pricing): the pricing function below
ADVISOR = {"price": "labkit.parallel.ep:mesh_time"}


class AllToAllExchange:
    """The ``exchange`` of an expert-parallel :class:`~labkit.models.moe.MoE`: rows sorted by global expert id go to the
    rank holding the expert and come back computed (module docstring, steps 1-4).

    ``sent`` counts what this rank sent to other ranks since the last :meth:`reset`: ``rows`` and ``bytes`` of
    activations (forward and backward), ``count_bytes`` of the counts' all-to-all.
    """

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self.sent = {"rows": 0, "bytes": 0, "count_bytes": 0}

    def reset(self) -> None:
        self.sent = {"rows": 0, "bytes": 0, "count_bytes": 0}

    def __call__(self, moe: MoE, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        E, local = moe.moe.n_expert, len(moe.experts)
        counts = torch.bincount(expert, minlength=E)                         # (E,) rows for each expert
        recv_counts = torch.empty_like(counts)                               # (N * local,) from rank j, expert e
        kdist.all_to_all_single(recv_counts, counts, group=self.group)
        self.sent["count_bytes"] += (E - local) * counts.element_size()
        send = counts.view(self.size, local).sum(1).tolist()
        recv = recv_counts.view(self.size, local).sum(1).tolist()
        got = AllToAll.apply(rows, recv, send, self.group, self.rank, self.sent)           # dispatch
        ids = torch.arange(local, device=rows.device).repeat(self.size).repeat_interleave(recv_counts)
        out = run_experts(moe.experts, got, ids)
        return AllToAll.apply(out, send, recv, self.group, self.rank, self.sent)           # combine


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (an FSDP2-sharded one is a DTensor; its local shard is averaged over ep,
    the ep peers holding the same shard of it)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def expert_params(model: nn.Module) -> set[int]:
    return {id(p) for m in moe_layers(model) for p in m.experts.parameters()}


class ExpertParallel(Dimension):
    """The ``ep`` mesh dimension: experts spread over the group, tokens exchanged by all-to-all (module docstring)."""

    name = "ep"

    def __init__(self, mesh, options: dict):
        super().__init__(mesh, options)
        self.data_parallel_size = self.size
        self.averages_gradients = self.size > 1  # the non-expert gradients

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        if self.size == 1:
            return
        if model_name not in MOE_SIZES:
            raise ConfigError(f"--mesh ep={self.size} spreads a mixture of experts; use --model "
                              f"{', '.join(MOE_SIZES)} (not {model_name}) or leave ep out")
        experts = MOE_SIZES[model_name][1].n_expert
        if experts % self.size:
            raise ConfigError(f"--mesh ep={self.size}: {model_name} has {experts} experts per layer, not a multiple "
                              f"of {self.size}; use an ep size that divides {experts}")

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Keep experts ``rank * E/N .. (rank + 1) * E/N - 1`` of every MoE layer, drop the others (in place)."""
        if self.size == 1:
            return model
        for moe in moe_layers(model):
            E = moe.moe.n_expert
            if E % self.size:
                raise ConfigError(f"--mesh ep={self.size}: {E} experts per layer is not a multiple of {self.size}")
            local = E // self.size
            moe.expert_offset = self.rank * local
            moe.experts = nn.ModuleList(list(moe.experts)[moe.expert_offset:moe.expert_offset + local])
            moe.exchange = AllToAllExchange(self.group, self.size, self.rank)
        return model

    def sync_gradients(self, model: nn.Module) -> None:
        """Average non-expert gradients over the group (one flat all-reduce); divide expert gradients by N."""
        if self.size == 1:
            return
        experts = expert_params(model)
        grads = [(id(p) in experts, _local(p.grad)) for p in model.parameters() if p.grad is not None]
        shared = [g for is_expert, g in grads if not is_expert]
        if shared:
            flat = torch.cat([g.reshape(-1) for g in shared])
            kdist.all_reduce(flat, group=self.group)
            flat /= self.size
            for g, avg in zip(shared, flat.split([g.numel() for g in shared])):
                g.copy_(avg.view_as(g))
        for is_expert, g in grads:
            if is_expert:
                g /= self.size

    @staticmethod
    def price(tokens: int, n_embd: int, top_k: int, n_expert: int, n_layer: int, ranks: int,
              bytes_per_element: int = 4) -> dict:
        """Bytes one rank sends per step with ``tokens`` tokens, routing spread evenly and nothing dropped
        (module docstring): ``all_to_all`` (activations), ``counts``."""
        remote = tokens * top_k * (ranks - 1) // ranks
        return {"all_to_all": n_layer * 4 * remote * n_embd * bytes_per_element,
                "counts": n_layer * n_expert * (ranks - 1) // ranks * 8}


def dense_allreduce_bytes(parameters: int, ranks: int, bytes_per_element: int = 4) -> int:
    """Bytes one rank sends per step in a ring all-reduce of ``parameters`` gradients: 2 (N − 1) / N · P · b."""
    return 2 * (ranks - 1) * parameters * bytes_per_element // ranks


def mesh_time(step) -> float:
    """A mesh step's ``ep`` term (:class:`labkit.parallel.pricing.MeshStep`), ``N`` ranks of stride 1, ``n = b·T``
    tokens per rank: ``ep = (A + K)·β + 5·L·(N − 1)·α`` with ``A`` and ``K`` the all-to-all bytes of the
    activations and the counts (:meth:`ExpertParallel.price`), per layer 5 all-to-alls (the counts, dispatch and
    combine forward and backward) of ``N − 1`` messages each."""
    n, g = step.plan.ep, step.gpt
    if n == 1:
        return 0.0
    link = step.link(n, 1)
    sent = ExpertParallel.price(step.b * step.tokens, g.n_embd, g.top_k, g.n_expert, g.n_layer, n, step.e)
    return (sent["all_to_all"] + sent["counts"]) * link.beta + 5 * g.n_layer * (n - 1) * link.alpha

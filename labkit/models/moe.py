"""A mixture-of-experts MLP for :class:`labkit.models.gpt.GPT`: a router sends each token to k of E experts.

    model = gpt_moe("gpt-moe-tiny", vocab_size=96)     # GPT whose blocks' MLPs are MoE layers (4 experts, top-1)
    moe = model.blocks[0].mlp                           # after a forward pass:
    moe.tokens_per_expert, moe.dropped, moe.aux         # (E,) choices per expert, dropped choices, aux loss

Routing (:func:`route`), per token x with router logits ``x Wᵣ`` (E values):

- ``p = softmax(x Wᵣ)``; the token's k experts are the k largest ``p``. k = 1 (Switch): gate ``g = p_e``, not
  renormalised (the router learns through it). k = 2 (GShard, Mixtral): ``g_j = p_j / (p_1 + p_2)``, the two
  gates sum to 1.
- Capacity: routing groups are single sequences, so a sequence's routing never depends on which other sequences
  share its batch or its rank (data and expert parallelism shard the batch by whole sequences and route exactly as
  one process does). An expert takes at most ``capacity = ceil(capacity_factor * T * k / E)`` choices from one
  sequence of T tokens, first choices before second choices, earlier positions first. A choice over capacity is
  *dropped*: it adds nothing; a token whose every choice is dropped leaves the layer as zeros, so the block's
  residual carries it through unchanged. ``capacity_factor=None``: no limit, nothing dropped.
- Output: ``y = Σ_kept g_j · expert_{e_j}(x)``; experts are plain :class:`labkit.models.gpt.MLP` s.

Load-balancing loss (Switch Transformer, eq. 4), per sequence, averaged over the batch's sequences::

    aux = α · E · Σ_i f_i · P_i      f_i = (choices of the sequence routed to expert i, before capacity) / (T k)
                                      P_i = mean over the sequence's T tokens of p_i

It is smallest (= α) when both are uniform. f_i is a count (no gradient); the gradient reaches the router through
P_i. The training loop never sees it: :class:`AddAuxLoss` passes the layer's output through unchanged and, in
backward, hands ``aux`` the gradient 1 — exactly what ``loss + aux`` would give — so :func:`labkit.train.loop.fit`,
every strategy and the single-process oracle get the same gradients from an unchanged loop. (It counts once per
forward pass; a loss that is scaled, e.g. for mixed precision, does not scale it.)

Kept on each :class:`MoE` after every forward, as tensors (reading them is the reporter's host sync):
``tokens_per_expert`` (E,) choices routed to each expert before capacity, ``kept_per_expert`` (E,) after it,
``dropped`` (choices dropped), ``aux`` (the balancing loss, detached). Under expert parallelism (:mod:`labkit.
parallel.ep`) they count this rank's tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labkit.models.gpt import GPT, GPT_SIZES, MLP, GPTConfig


@dataclass(frozen=True)
class MoEConfig:
    """``n_expert`` experts per layer, ``top_k`` (1 or 2) of them per token, the capacity factor (``None``: no
    limit) and the balancing loss's weight α."""

    n_expert: int = 4
    top_k: int = 1
    capacity_factor: float | None = None
    aux_alpha: float = 0.01

    def __post_init__(self):
        if self.top_k not in (1, 2) or self.top_k > self.n_expert:
            raise ValueError(f"top_k must be 1 or 2 and at most n_expert ({self.n_expert}), got {self.top_k}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")


#: ``--model`` sizes: a GPT size and its experts (``gpt-moe`` = ``gpt-moe-tiny``)
MOE_SIZES: dict[str, tuple[GPTConfig, MoEConfig]] = {
    "gpt-moe-tiny": (GPT_SIZES["gpt-tiny"], MoEConfig(n_expert=4, top_k=1, capacity_factor=None)),
    "gpt-moe-tiny-top2": (GPT_SIZES["gpt-tiny"], MoEConfig(n_expert=4, top_k=2, capacity_factor=1.25)),
    "gpt-moe-small": (GPT_SIZES["gpt-small"], MoEConfig(n_expert=8, top_k=2, capacity_factor=1.25)),
}
MOE_SIZES["gpt-moe"] = MOE_SIZES["gpt-moe-tiny"]


def capacity(tokens: int, top_k: int, n_expert: int, capacity_factor: float | None) -> int:
    """Most choices one expert takes from a routing group of ``tokens`` tokens (``tokens * top_k`` if no limit)."""
    if capacity_factor is None:
        return tokens * top_k
    return math.ceil(capacity_factor * tokens * top_k / n_expert)


@dataclass
class Routing:
    """Where each token of a (G, T) batch of routing groups goes: ``experts``, ``gates``, ``keep`` are (G, T, k)."""

    experts: torch.Tensor  # (G, T, k) long, the chosen experts, best first
    gates: torch.Tensor    # (G, T, k) the weights their outputs are summed with
    keep: torch.Tensor     # (G, T, k) bool, False: dropped (over capacity)


def route(probs: torch.Tensor, top_k: int, capacity_factor: float | None) -> Routing:
    """Top-k routing of router probabilities ``probs`` (G, T, E), with per-group capacity (module docstring)."""
    G, T, E = probs.shape
    top, experts = probs.topk(top_k, dim=-1)                                # (G, T, k)
    gates = top if top_k == 1 else top / top.sum(-1, keepdim=True)
    cap = capacity(T, top_k, E, capacity_factor)
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        taken = torch.zeros(G, 1, E, dtype=torch.long, device=probs.device)  # choices each expert already holds
        for j in range(top_k):                                               # first choices fill first
            onehot = F.one_hot(experts[..., j], E)                           # (G, T, E)
            slot = (onehot.cumsum(1) - 1 + taken).gather(-1, experts[..., j:j + 1]).squeeze(-1)  # (G, T)
            keep[..., j] = slot < cap
            taken = taken + onehot.sum(1, keepdim=True)
    return Routing(experts, gates, keep)


def balance_loss(probs: torch.Tensor, experts: torch.Tensor, alpha: float) -> torch.Tensor:
    """α · E · Σ_i f_i · P_i per routing group, averaged over the groups (module docstring).

    Args:
        probs: (G, T, E) router probabilities.
        experts: (G, T, k) the chosen experts (before capacity).
    """
    G, T, E = probs.shape
    f = F.one_hot(experts, E).sum((1, 2)).to(probs.dtype) / (T * experts.shape[-1])  # (G, E), no gradient
    P = probs.mean(1)                                                                 # (G, E)
    return alpha * E * (f * P).sum(-1).mean()


class AddAuxLoss(torch.autograd.Function):
    """``y = AddAuxLoss.apply(x, aux)`` returns ``x`` unchanged; backward gives ``x`` its gradient and ``aux`` the
    gradient 1, as if ``aux`` had been added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


def run_experts(experts: nn.ModuleList, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``out[r] = experts[ids[r]](rows[r])`` for rows (N, C) and local expert ids (N,).

    Every expert runs, on no rows if none came: its gradient is then zeros, not ``None``, and ``out`` always
    depends on ``rows``, so backward runs each all-to-all of expert parallelism on every rank (a rank that skipped
    one would leave its peers waiting)."""
    out = rows.new_zeros(rows.shape)
    for e, expert in enumerate(experts):
        idx = (ids == e).nonzero(as_tuple=True)[0]
        out = out.index_copy(0, idx, expert(rows[idx]))
    return out


class MoE(nn.Module):
    """(B, T, C) -> (B, T, C): a router (``Linear(C, E)``, no bias) and E :class:`labkit.models.gpt.MLP` experts.

    ``experts`` holds this rank's experts, global numbers ``expert_offset ..``; ``exchange`` (``None`` on one
    process) moves rows to the rank holding their expert and back (:class:`labkit.parallel.ep.AllToAllExchange`).
    """

    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.router = nn.Linear(cfg.n_embd, moe.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(moe.n_expert))
        self.expert_offset = 0
        self.exchange = None
        E = moe.n_expert
        self.tokens_per_expert = torch.zeros(E, dtype=torch.long)
        self.kept_per_expert = torch.zeros(E, dtype=torch.long)
        self.dropped = torch.zeros((), dtype=torch.long)
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        E, k = self.moe.n_expert, self.moe.top_k
        logits = self.router(x)
        probs = F.softmax(logits.float() if logits.element_size() < 4 else logits, dim=-1)  # (B, T, E), >= fp32
        r = route(probs, k, self.moe.capacity_factor)
        aux = balance_loss(probs, r.experts, self.moe.aux_alpha)
        with torch.no_grad():
            self.tokens_per_expert = torch.bincount(r.experts.flatten(), minlength=E)
            self.kept_per_expert = torch.bincount(r.experts[r.keep], minlength=E)
            self.dropped = (~r.keep).sum()
            self.aux = aux.detach()
        # the kept (token, choice) pairs, sorted by expert: the order both paths send rows in
        token = torch.arange(B * T, device=x.device).repeat_interleave(k).view(B, T, k)[r.keep]  # (P,)
        expert, gate = r.experts[r.keep], r.gates[r.keep]
        order = torch.argsort(expert, stable=True)
        token, expert, gate = token[order], expert[order], gate[order].to(x.dtype)
        rows = x.reshape(B * T, C)[token]                                       # (P, C)
        if self.exchange is None:
            out = run_experts(self.experts, rows, expert)
        else:
            out = self.exchange(self, rows, expert)
        y = x.new_zeros(B * T, C).index_add(0, token, out * gate[:, None]).view(B, T, C)
        if self.training and self.moe.aux_alpha:
            y = AddAuxLoss.apply(y, aux)
        return y


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def make_moe(model: GPT, moe: MoEConfig) -> GPT:
    """Replace every block's MLP of ``model`` by an :class:`MoE` (in place; returns ``model``). Experts are
    initialised as the GPT initialises its MLPs, the router as its linear layers (N(0, 0.02))."""
    cfg = model.cfg
    for block in model.blocks:
        block.mlp = MoE(cfg, moe)
        block.mlp.apply(GPT._init)
        for name, p in block.mlp.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
    return model


def gpt_moe(name: str, vocab_size: int, block_size: int | None = None, **changes) -> GPT:
    """The GPT of size ``name`` (:data:`MOE_SIZES`) with MoE MLPs. ``changes`` may set GPTConfig fields and
    MoEConfig fields (``n_expert``, ``top_k``, ``capacity_factor``, ``aux_alpha``)."""
    base, moe = MOE_SIZES[name]
    moe_fields = {key: changes.pop(key) for key in list(changes) if key in MoEConfig.__dataclass_fields__}
    moe = MoEConfig(**{**moe.__dict__, **moe_fields})
    cfg = base.replace(vocab_size=vocab_size, **changes)
    if block_size is not None:
        cfg = cfg.replace(block_size=block_size)
    return make_moe(GPT(cfg), moe)

"""The mesh search for a GPT: every ``dp×tp×pp×cp`` mesh (``dp×ep`` for a mixture of experts) on a topology's
devices, with micro-batch counts, sequence parallelism, ZeRO stages and recomputation, priced by the dimensions'
own formulas and pruned by memory per device.

A plan's step on ``N = dp·tp·pp·cp·ep`` devices, global batch ``B`` sequences of ``T`` tokens, ``m``
micro-batches of ``b = B/(dp·ep·m)`` sequences per pipeline column, ``e = 2`` bytes per element (bf16), peak
``F`` FLOP/s per device at efficiency ``η`` (an assumption, :data:`EFFICIENCY`), terms in this order:

* ``compute = (6·P_a·B·T + 12·L·B·T²·C) / (N·F·η)`` (Narayanan et al. 2021: forward and backward of the
  matrix products and attention's scores; ``P_a`` the parameters a token passes, a MoE's ``k`` experts of
  ``E``), ``× 4/3`` with recomputation (the forward again);
* ``bubble = (pp − 1)/m · compute`` (GPipe and 1F1B alike);
* then one term per mesh dimension, priced by the function its module's ``ADVISOR`` literal names, beside its
  ``FLAGS`` (:func:`labkit.parallel.registered`): ``tp``, ``cp``, ``ep``, ``pp``, ``dp``, each reading a
  :class:`MeshStep`. Nothing overlaps with compute: an upper bound.

Each collective uses the link its group spans (:meth:`labkit.advisor.topology.Topology.collective_link`): ranks
are laid out ``pp, dp, cp, tp`` (``dp, ep`` for a MoE) with the last innermost, so a group of size ``g`` and
stride ``s`` spans ``g·s`` ranks. Memory per device (mixed precision with Adam: 2 + 2 + 12 bytes per parameter,
Rajbhandari et al. 2020): ``parameters 2·P_dev``, ``gradients 2·P_dev``, ``optimizer 12·P_dev`` (ZeRO 1 shards
the optimizer over the ``d`` ranks holding the same weights, 2 also the gradients, 3 all three), ``activations``
= :func:`labkit.parallel.megatron_cost.activation_bytes_per_layer` (a MoE's ``k`` experts add ``(k − 1)·8·bTC``
elements) × ``L/pp`` × the micro-batches in flight (``min(pp, m)``, 1F1B); with recomputation only each block's
input is kept plus one block's activations.
"""
from __future__ import annotations

import functools
import importlib
import itertools
from dataclasses import dataclass, field

from labkit.advisor.topology import Topology

E = 2                #: bytes per element of weights, activations and messages (bf16)
ADAM = 12            #: bytes per parameter of the optimizer: fp32 master copy, momentum, variance
EFFICIENCY = 0.4     #: share of the peak FLOP/s a training step reaches (an assumption, not measured)
GB = 2**30


@dataclass(frozen=True)
class GPTShape:
    """``L`` blocks of width ``C`` with ``a`` heads, vocabulary ``V``, sequence ``T``; a mixture of experts has
    ``n_expert`` MLPs per block, ``top_k`` of them per token (0: a dense GPT)."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    seq: int
    name: str = "GPT"
    n_expert: int = 0
    top_k: int = 0

    @property
    def mlp_params(self) -> int:
        """One MLP: ``C → 4C → C`` with biases, ``8C² + 5C``."""
        return 8 * self.n_embd ** 2 + 5 * self.n_embd

    @property
    def block_params(self) -> int:
        """Attention and two layer norms ``4C² + 8C``, then one MLP (``12C² + 13C`` in all) or a router ``C·E``
        and ``E`` MLPs."""
        C, E = self.n_embd, self.n_expert
        return 4 * C * C + 8 * C + (C * E + E * self.mlp_params if E else self.mlp_params)

    @property
    def expert_params(self) -> int:
        return self.n_layer * self.n_expert * self.mlp_params

    @property
    def params(self) -> int:
        return self.n_layer * self.block_params + (self.vocab_size + self.seq) * self.n_embd

    @property
    def active_params(self) -> int:
        """``P_a``: the parameters one token passes (a MoE's ``k`` experts of ``E``)."""
        return self.params - self.expert_params + self.n_layer * self.top_k * self.mlp_params

    def config(self, n_layer: int | None = None):
        from labkit.gpt import GPTConfig

        return GPTConfig(self.vocab_size, self.seq, n_layer or self.n_layer, self.n_head, self.n_embd)


#: GPT-3's 1.3B shape (Brown et al. 2020) at sequence 4096, GPT-2's vocabulary padded to 50304
GPT_1_3B = GPTShape(24, 16, 2048, 50304, 4096, "1.3B")


def gpt_shape(model: str, seq: int | None = None) -> GPTShape:
    """``--model``'s GPT (``gpt-1.3b``, one of :data:`labkit.gpt.GPT_SIZES` or :data:`labkit.moe.MOE_SIZES` by its
    ``LANGUAGE_MODELS`` name) with GPT-2's vocabulary (50304) at sequence ``seq`` (default its block size)."""
    from labkit.errors import ConfigError
    from labkit.gpt import GPT_SIZES
    from labkit.model_names import LANGUAGE_MODELS
    from labkit.moe import MOE_SIZES

    if model == "gpt-1.3b":
        return GPTShape(**{**GPT_1_3B.__dict__, "seq": seq or GPT_1_3B.seq})
    cfg, moe = MOE_SIZES.get(model, (GPT_SIZES.get(LANGUAGE_MODELS.get(model, "")), None))
    if cfg is None:
        raise ConfigError(f"the mesh search prices a dense GPT: gpt-1.3b or {', '.join(GPT_SIZES)}, or a mixture of "
                          f"experts: {', '.join(MOE_SIZES)}; not {model!r}")
    experts = (moe.n_expert, moe.top_k) if moe else (0, 0)
    return GPTShape(cfg.n_layer, cfg.n_head, cfg.n_embd, 50304, seq or cfg.block_size, model, *experts)


@dataclass(frozen=True)
class MeshPlan:
    """A mesh (dp, tp, pp, cp, ep sizes) and its options: micro-batches, ZeRO stage, SP, recomputation."""

    dp: int
    tp: int
    pp: int
    cp: int
    microbatches: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: bool = False
    ep: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def label(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp),
                                                 ("ep", self.ep)) if v > 1) or "one device"
        extra = [f"m={self.microbatches}" if self.pp > 1 else "", f"zero{self.zero}" if self.zero else "",
                 "sp" if self.sequence_parallel else "", "recompute" if self.recompute else ""]
        return " ".join([dims, *filter(None, extra)])


@dataclass
class MeshEstimate:
    """A plan's time terms (seconds per step) and memory terms (bytes per device) against ``limit_bytes``."""

    plan: MeshPlan
    time: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    limit_bytes: float = float("inf")

    @property
    def step_s(self) -> float:
        return sum(self.time.values())

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def feasible(self) -> bool:
        return self.peak_bytes <= self.limit_bytes


@dataclass(frozen=True)
class MeshStep:
    """What each dimension's pricing function reads: the plan, the GPT, the topology and the global batch."""

    plan: MeshPlan
    gpt: GPTShape
    topo: Topology
    batch: int
    e: int = E

    @property
    def b(self) -> int:
        """Sequences per micro-batch of one pipeline column: ``B/(dp·ep·m)``."""
        return self.batch // (self.plan.dp * self.plan.ep * self.plan.microbatches)

    @property
    def layers(self) -> int:
        """``L_s = L/pp``, the blocks of one stage."""
        return self.gpt.n_layer // self.plan.pp

    @property
    def tokens(self) -> int:
        """A rank's share of the sequence, ``T/cp``."""
        return self.gpt.seq // self.plan.cp

    @property
    def stage(self):
        return self.gpt.config(self.layers)

    def link(self, size: int, stride: int):
        """The link a group of ``size`` ranks ``stride`` apart spans."""
        return self.topo.collective_link(size * stride)

    @property
    def replicas(self) -> list[tuple[float, int, int]]:
        """``(bytes, d, stride)`` per set of weights held alike by ``d`` ranks: a dense stage's ``P/(t·pp)`` over
        ``dp·cp``; a MoE's shared weights over ``dp·ep``, its experts (``E/ep`` per rank) over ``dp``."""
        g, p = self.gpt, self.plan
        if g.n_expert:
            return [(self.e * (g.params - g.expert_params), p.dp * p.ep, 1),
                    (self.e * g.expert_params / p.ep, p.dp, p.ep)]
        stage = self.layers * g.block_params + (g.vocab_size + g.seq) * g.n_embd
        return [(self.e * stage / p.tp, p.dp * p.cp, p.tp)]


@functools.lru_cache(maxsize=None)
def pricers() -> dict:
    """``{dimension: its pricing function}`` from the ``ADVISOR`` literals beside the dimensions' ``FLAGS``."""
    from labkit.parallel import registered

    out = {}
    for dim, entry in registered("ADVISOR").items():
        module, _, attr = entry["price"].partition(":")
        out[dim] = getattr(importlib.import_module(module), attr)
    return out


def price_mesh(plan: MeshPlan, gpt: GPTShape, topo: Topology, batch: int, efficiency: float = EFFICIENCY
               ) -> MeshEstimate:
    """The terms of the module docstring, in its order, for ``plan`` (see there for every formula)."""
    from labkit.parallel.megatron_cost import activation_bytes_per_layer

    step = MeshStep(plan, gpt, topo, batch)
    L, C, T = gpt.n_layer, gpt.n_embd, gpt.seq
    flops = 6 * gpt.active_params * batch * T + 12 * L * batch * T * T * C
    compute = flops / (plan.devices * topo.flops * efficiency) * (4 / 3 if plan.recompute else 1)
    time = {"compute": compute, "bubble": (plan.pp - 1) / plan.microbatches * compute}
    for dim, price in pricers().items():
        time[dim] = price(step)
    memory = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
    for nbytes, d, _ in step.replicas:
        shard = {0: (1, 1, 1), 1: (1, 1, d), 2: (1, d, d), 3: (d, d, d)}[plan.zero]
        for key, per, s in zip(memory, (nbytes, nbytes, nbytes * ADAM / E), shard):
            memory[key] += per / s
    b, s = step.b, step.tokens
    layer = activation_bytes_per_layer(b, s, C, gpt.n_head, plan.tp, plan.sequence_parallel, E)
    layer += max(0, gpt.top_k - 1) * 8 * b * s * C * E
    held = min(plan.pp, plan.microbatches) * step.layers
    memory["activations"] = held * b * s * C * E + layer if plan.recompute else held * layer
    return MeshEstimate(plan, time, memory, topo.memory_bytes)


def _valid(plan: MeshPlan, gpt: GPTShape, batch: int) -> bool:
    """What the dimensions accept: tp divides the heads, pp the blocks, 2·cp the sequence (zig-zag), cp and pp
    not together, ep the experts (a MoE takes only dp and ep), ``dp·ep·m`` the batch, ``m ≥ pp`` with a pipeline
    (else 1), ZeRO and SP only where they act."""
    p = plan
    moe = p.tp == p.pp == p.cp == 1 and gpt.n_expert % p.ep == 0 if gpt.n_expert else p.ep == 1
    return (moe and gpt.n_head % p.tp == 0 and gpt.n_layer % p.pp == 0 and gpt.seq % (2 * p.cp) == 0
            and not (p.cp > 1 and p.pp > 1) and batch % (p.dp * p.ep * p.microbatches) == 0
            and (p.microbatches >= p.pp if p.pp > 1 else p.microbatches == 1)
            and (p.zero == 0 or p.dp * p.cp * p.ep > 1) and (not p.sequence_parallel or p.tp > 1))


def meshes(devices: int, gpt: GPTShape, batch: int, microbatches=(1, 2, 4, 8, 16, 32)) -> list[MeshPlan]:
    """Every valid plan using all ``devices``: ``dp·tp·pp·cp·ep = N`` over its divisors."""
    out = []
    divisors = [k for k in range(1, devices + 1) if devices % k == 0]
    for tp, pp, cp, ep in itertools.product(divisors, repeat=4):
        if devices % (tp * pp * cp * ep):
            continue
        dp = devices // (tp * pp * cp * ep)
        for m, zero, sp, rc in itertools.product(microbatches, range(4), (False, True), (False, True)):
            plan = MeshPlan(dp, tp, pp, cp, m, zero, sp, rc, ep)
            if _valid(plan, gpt, batch):
                out.append(plan)
    return out


def _key(e: MeshEstimate) -> tuple:
    return (not e.feasible, e.step_s, e.peak_bytes, e.plan.label)


def search(gpt: GPTShape, topo: Topology, batch: int, devices: int | None = None) -> list[MeshEstimate]:
    """Every plan of :func:`meshes` priced, best first (plans that do not fit last)."""
    return sorted((price_mesh(p, gpt, topo, batch) for p in meshes(devices or topo.ranks, gpt, batch)), key=_key)


def frontier(estimates: list[MeshEstimate]) -> list[MeshEstimate]:
    """The feasible plans no other beats on both step time and memory (fastest first)."""
    out: list[MeshEstimate] = []
    for e in sorted((e for e in estimates if e.feasible), key=_key):
        if not out or e.peak_bytes < out[-1].peak_bytes:
            out.append(e)
    return out


def explain(estimates: list[MeshEstimate], gpt: GPTShape, topo: Topology) -> str:
    """Why the best plan wins, in words: the faster plan that does not fit (if one is faster), then against
    the best plan of each of the next mesh shapes, the term that decides, or the memory that rules it out."""
    best = estimates[0]
    if not best.feasible:
        return f"on {topo.name}, no plan for a {gpt.name} GPT at sequence {gpt.seq} fits in memory"
    seen, reasons = {_shape(best.plan)}, []
    fastest = min(estimates, key=lambda e: e.step_s)
    if not fastest.feasible:
        reasons.append(f"the faster {fastest.plan.label} ({fastest.step_s * 1e3:.0f} ms) needs "
                       f"{fastest.peak_bytes / GB:.0f} GB per GPU (> {topo.memory_bytes / GB:.0f})")
    for e in estimates:
        if _shape(e.plan) in seen:
            continue
        seen.add(_shape(e.plan))
        if not e.feasible:
            reasons.append(f"{e.plan.label} needs {e.peak_bytes / GB:.0f} GB per GPU (> "
                           f"{topo.memory_bytes / GB:.0f})")
        else:
            term = max(e.time, key=lambda k: e.time[k] - best.time.get(k, 0.0))
            reasons.append(f"{e.plan.label} is {(e.step_s / best.step_s - 1):.0%} slower ({term} "
                           f"{e.time[term] * 1e3:.0f} ms against {best.time[term] * 1e3:.0f} ms)")
        if len(reasons) >= 3:
            break
    return (f"on {topo.name}, a {gpt.name} GPT at sequence {gpt.seq}: {best.plan.label} "
            f"({best.step_s * 1e3:.0f} ms/step, {best.peak_bytes / GB:.0f} GB per GPU) because "
            + "; ".join(reasons))


def _shape(plan: MeshPlan) -> tuple:
    return plan.dp, plan.tp, plan.pp, plan.cp, plan.ep

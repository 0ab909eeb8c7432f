"""The mesh search for a GPT: every ``dp×tp×pp×cp`` mesh on a topology's devices, with micro-batch counts,
sequence parallelism, ZeRO stages and recomputation, priced by the dimensions' own formulas and pruned by
memory per device.

A plan's step on ``N = dp·tp·pp·cp`` devices, global batch ``B`` sequences of ``T`` tokens, ``m`` micro-batches
of ``b = B/(dp·m)`` sequences per pipeline column, ``e = 2`` bytes per element (bf16), peak ``F`` FLOP/s per
device at efficiency ``η`` (an assumption, :data:`EFFICIENCY`), terms in this order:

* ``compute = (6·P_L·B·T + 12·L·B·T²·C) / (N·F·η)`` (Narayanan et al. 2021: forward and backward of the
  matrix products and attention's scores), ``× 4/3`` with recomputation (the forward again);
* ``bubble = (pp − 1)/m · compute`` (GPipe and 1F1B alike);
* ``tp = m·(w·β + n·2(t − 1)·α)`` with ``w`` the ring's wire bytes of
  :func:`labkit.parallel.megatron_cost.tp_step_bytes` for one micro-batch of the stage's ``L/pp`` blocks and
  ``n = 4L/pp + 2`` collectives (SP moves the same bytes);
* ``cp = m·(bytes·β + 4·(cp − 1)·L/pp·α)``, the K/V ring of ``ContextParallel.price``;
* ``pp = m·2·(α + β·a)`` with ``a`` one micro-batch's activation at a stage boundary (``PipelineParallel.price``;
  ``/t`` with SP), plus the tied embedding's gradient all-reduce between first and last stage;
* ``dp = bytes·β + 2(d − 1)·α`` over the ``d = dp·cp`` ranks that hold the same weights: ``labkit.parallel.dp``'s
  price of this device's ``P/(t·pp)`` parameters (``none`` for ZeRO 0-2: all-reduce = reduce-scatter +
  all-gather; ``fsdp`` for ZeRO 3). Nothing overlaps with compute: an upper bound.

Each collective uses the link its group spans (:meth:`labkit.advisor.topology.Topology.collective_link`): ranks
are laid out ``pp, dp, cp, tp`` with tp innermost, so a group of size ``g`` and stride ``s`` spans ``g·s`` ranks.
Memory per device (mixed precision with Adam: 2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2020):
``parameters 2·P_dev``, ``gradients 2·P_dev``, ``optimizer 12·P_dev`` (ZeRO 1 shards the optimizer over ``d``,
2 also the gradients, 3 all three), ``activations`` =
:func:`labkit.parallel.megatron_cost.activation_bytes_per_layer` × ``L/pp`` × the micro-batches in flight
(``min(pp, m)``, 1F1B); with recomputation only each block's input is kept plus one block's activations.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from labkit.advisor.topology import Topology

E = 2                #: bytes per element of weights, activations and messages (bf16)
ADAM = 12            #: bytes per parameter of the optimizer: fp32 master copy, momentum, variance
EFFICIENCY = 0.4     #: share of the peak FLOP/s a training step reaches (an assumption, not measured)
GB = 2**30


@dataclass(frozen=True)
class GPTShape:
    """``L`` blocks of width ``C`` with ``a`` heads, vocabulary ``V``, sequence ``T``."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    seq: int
    name: str = "GPT"

    @property
    def block_params(self) -> int:
        return 12 * self.n_embd ** 2 + 13 * self.n_embd

    @property
    def params(self) -> int:
        return self.n_layer * self.block_params + (self.vocab_size + self.seq) * self.n_embd

    def config(self, n_layer: int | None = None):
        from labkit.gpt import GPTConfig

        return GPTConfig(self.vocab_size, self.seq, n_layer or self.n_layer, self.n_head, self.n_embd)


#: GPT-3's 1.3B shape (Brown et al. 2020) at sequence 4096, GPT-2's vocabulary padded to 50304
GPT_1_3B = GPTShape(24, 16, 2048, 50304, 4096, "1.3B")


def gpt_shape(model: str, seq: int | None = None) -> GPTShape:
    """``--model``'s GPT (``gpt-1.3b`` or one of :data:`labkit.gpt.GPT_SIZES` by its ``LANGUAGE_MODELS`` name)
    with GPT-2's vocabulary (50304) at sequence ``seq`` (default its block size)."""
    from labkit.errors import ConfigError
    from labkit.gpt import GPT_SIZES
    from labkit.model_names import LANGUAGE_MODELS

    if model == "gpt-1.3b":
        return GPTShape(**{**GPT_1_3B.__dict__, "seq": seq or GPT_1_3B.seq})
    cfg = GPT_SIZES.get(LANGUAGE_MODELS.get(model, ""))
    if cfg is None:
        raise ConfigError(f"the mesh search prices a dense GPT: gpt-1.3b or {', '.join(GPT_SIZES)}, not {model!r}")
    return GPTShape(cfg.n_layer, cfg.n_head, cfg.n_embd, 50304, seq or cfg.block_size, model)


@dataclass(frozen=True)
class MeshPlan:
    """A mesh (dp, tp, pp, cp sizes) and its options: micro-batches, ZeRO stage, SP, recomputation."""

    dp: int
    tp: int
    pp: int
    cp: int
    microbatches: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: bool = False

    @property
    def label(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
                        if v > 1) or "one device"
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


def _link(topo: Topology, size: int, stride: int):
    return topo.collective_link(size * stride)


def price_mesh(plan: MeshPlan, gpt: GPTShape, topo: Topology, batch: int, efficiency: float = EFFICIENCY
               ) -> MeshEstimate:
    """The terms of the module docstring, in its order, for ``plan`` (see there for every formula)."""
    from labkit.parallel.cp import ContextParallel
    from labkit.parallel.dp import price as dp_price
    from labkit.parallel.megatron_cost import activation_bytes_per_layer, ring_wire_bytes, tp_step_bytes
    from labkit.parallel.pp import PipelineParallel

    dp, t, pp, cp, m = plan.dp, plan.tp, plan.pp, plan.cp, plan.microbatches
    n, L, C, T = dp * t * pp * cp, gpt.n_layer, gpt.n_embd, gpt.seq
    flops = 6 * gpt.params * batch * T + 12 * L * batch * T * T * C
    compute = flops / (n * topo.flops * efficiency) * (4 / 3 if plan.recompute else 1)
    time = {"compute": compute, "bubble": (pp - 1) / m * compute}
    b, ls = batch // (dp * m), L // pp
    stage = gpt.config(ls)
    link = _link(topo, t, 1)
    wire = ring_wire_bytes(tp_step_bytes(stage, b, T // cp, t, plan.sequence_parallel, E), t) if t > 1 else 0
    time["tp"] = m * (wire * link.beta + (4 * ls + 2) * 2 * (t - 1) * link.alpha) if t > 1 else 0.0
    link = _link(topo, cp, t)
    ring = ContextParallel.price(stage, b, T, cp, E)["p2p"] if cp > 1 else 0
    time["cp"] = m * (ring * link.beta + 4 * (cp - 1) * ls * link.alpha) if cp > 1 else 0.0
    link = _link(topo, pp, dp * cp * t)
    sent = PipelineParallel.price(b, T // cp, C, gpt.vocab_size, pp, t, plan.sequence_parallel, True, E)
    time["pp"] = (m * 2 * (link.alpha + link.beta * sent["activations"] / (2 * (pp - 1))) + sent["embedding"]
                  * link.beta) if pp > 1 else 0.0
    p_dev = (ls * gpt.block_params + (gpt.vocab_size + T) * C) / t
    d, link = dp * cp, _link(topo, dp * cp, t)
    grad = dp_price(E * p_dev, d, "fsdp" if plan.zero == 3 else "none")["bytes"]
    time["dp"] = grad * link.beta + 2 * (d - 1) * link.alpha if d > 1 else 0.0
    shard = {0: (1, 1, 1), 1: (1, 1, d), 2: (1, d, d), 3: (d, d, d)}[plan.zero]
    held = min(pp, m)
    if plan.recompute:
        acts = held * ls * b * (T // cp) * C * E + activation_bytes_per_layer(b, T // cp, C, gpt.n_head, t,
                                                                              plan.sequence_parallel, E)
    else:
        acts = held * ls * activation_bytes_per_layer(b, T // cp, C, gpt.n_head, t, plan.sequence_parallel, E)
    memory = {"parameters": E * p_dev / shard[0], "gradients": E * p_dev / shard[1],
              "optimizer": ADAM * p_dev / shard[2], "activations": acts}
    return MeshEstimate(plan, time, memory, topo.memory_bytes)


def _valid(plan: MeshPlan, gpt: GPTShape, batch: int) -> bool:
    """What the dimensions accept: tp divides the heads, pp the blocks, 2·cp the sequence (zig-zag), cp and pp
    not together, ``dp·m`` the batch, ``m ≥ pp`` with a pipeline (else 1), ZeRO and SP only where they act."""
    p = plan
    return (gpt.n_head % p.tp == 0 and gpt.n_layer % p.pp == 0 and gpt.seq % (2 * p.cp) == 0
            and not (p.cp > 1 and p.pp > 1) and batch % (p.dp * p.microbatches) == 0
            and (p.microbatches >= p.pp if p.pp > 1 else p.microbatches == 1)
            and (p.zero == 0 or p.dp * p.cp > 1) and (not p.sequence_parallel or p.tp > 1))


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def meshes(devices: int, gpt: GPTShape, batch: int, microbatches=(1, 2, 4, 8, 16, 32)) -> list[MeshPlan]:
    """Every valid plan using all ``devices``: ``dp·tp·pp·cp = N`` over its divisors."""
    out = []
    for tp, pp, cp in itertools.product(divisors(devices), repeat=3):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        for m, zero, sp, rc in itertools.product(microbatches, range(4), (False, True), (False, True)):
            plan = MeshPlan(dp, tp, pp, cp, m, zero, sp, rc)
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
    return plan.dp, plan.tp, plan.pp, plan.cp

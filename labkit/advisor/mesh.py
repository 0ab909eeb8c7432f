"""The mesh search: every ``dp×tp×pp×cp`` mesh of a GPT (``dp×ep`` for a mixture of experts), every ``dp×pp``
mesh of a CNN, on a topology's devices, with micro-batch counts, ZeRO stages (and for a GPT sequence parallelism
and recomputation), priced by the dimensions' own formulas and pruned by memory per device.

A plan's step on ``N = dp·tp·pp·cp·ep`` devices, global batch ``B``, ``m`` micro-batches of ``b = B/(dp·ep·m)``
samples per pipeline column, terms in this order:

* ``compute``: a GPT's ``(6·P_a·B·T + 12·L·B·T²·C) / (N·F·η)`` (Narayanan et al. 2021: the matrix products and
  attention's scores, forward and backward, for sequences of ``T`` tokens; ``P_a`` the parameters a token
  passes, a MoE's ``k`` experts of ``E``; ``F`` the device's peak FLOP/s at efficiency ``η``, an assumption,
  :data:`EFFICIENCY`), ``× 4/3`` with recomputation (the forward again); a CNN's ``s·m·max_j T_j(b)`` from
  its profile (stage ``j``'s layers as ``labkit train --mesh`` cuts them, evenly; ``s`` the topology's
  :func:`~labkit.advisor.alphabeta.compute_scale`);
* ``bubble = (pp − 1)/m · compute`` (GPipe and 1F1B alike);
* one term per mesh dimension, priced by the function its module's ``ADVISOR`` literal names, beside its
  ``FLAGS`` (:func:`labkit.parallel.registered`): ``tp``, ``cp``, ``ep``, ``pp``, ``dp``, each reading a
  :class:`MeshStep`. A CNN enters them as a model of one token per sample whose stage boundary carries its
  widest cut's activation and which ties no embedding (:class:`CNNStep`). Nothing overlaps with compute;
* a CNN also pays :func:`~labkit.advisor.alphabeta.common_terms` (``update`` of its shard, ``data``).

Each collective uses the link its group spans (:meth:`labkit.advisor.topology.Topology.link_of`): ranks
are laid out ``pp, dp, cp, tp`` (``dp, ep`` for a MoE) with the last innermost, so a group of size ``g`` and
stride ``s`` spans ``g·s`` ranks. Memory per device: ``parameters``, ``gradients``, ``optimizer`` (a GPT in
mixed precision with Adam, 2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2020; a CNN in fp32 with
momentum, 4 + 4 + 4), ZeRO 1 sharding the optimizer over the ``d`` ranks holding the same weights, 2 also the
gradients, 3 all three; ``activations`` for the micro-batches in flight (``min(pp, m)``, 1F1B): a GPT's
:func:`labkit.parallel.megatron_cost.activation_bytes_per_layer` × ``L/pp`` (a MoE's ``k`` experts add
``(k − 1)·8·bTC`` elements; with recomputation each block's input plus one block's activations), a CNN's
saved bytes of its fullest stage.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from labkit.advisor.alphabeta import common_terms, compute_scale, memory_terms, stages_of
from labkit.advisor.plan import Estimate, GPTShape, Profile
from labkit.advisor.search import MICROBATCHES, load
from labkit.advisor.topology import Topology

E = 2                #: bytes per element of a GPT's weights, activations and messages (bf16)
ADAM = 12            #: bytes per parameter of a GPT's optimizer: fp32 master copy, momentum, variance
EFFICIENCY = 0.4     #: share of the peak FLOP/s a training step reaches (an assumption, not measured)
GB, MB = 2**30, 2**20


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


@dataclass(frozen=True)
class MeshStep:
    """What each dimension's pricing function reads: the plan, the model's shape, the topology, the global batch
    and the bytes per element ``e``."""

    plan: MeshPlan
    gpt: GPTShape
    topo: Topology
    batch: int
    e: int = E

    @property
    def b(self) -> int:
        """Samples (sequences) per micro-batch of one pipeline column: ``B/(dp·ep·m)``."""
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
        return self.topo.link_of("p2p", size * stride)

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


@dataclass(frozen=True)
class CNNStep(MeshStep):
    """A CNN's step: ``gpt`` is its shape as the formulas read it (one token per sample, ``n_embd`` elements
    across the widest stage boundary, no tied embedding); ``stages`` its layers per stage; fp32 (``e = 4``)."""

    prof: Profile | None = None
    stages: tuple = ()

    @property
    def replicas(self) -> list[tuple[float, int, int]]:
        """The fullest stage's parameters over its ``dp`` replicas (``dp`` innermost: stride 1)."""
        return [(max(self.prof.params(s) for s in self.stages), self.plan.dp, 1)]


@functools.lru_cache(maxsize=None)
def pricers() -> dict:
    """``{dimension: its pricing function}`` from the ``ADVISOR`` literals beside the dimensions' ``FLAGS``."""
    from labkit.parallel import registered

    return {dim: load(entry["price"]) for dim, entry in registered("ADVISOR").items()}


def _weights(plan: MeshPlan, replicas, optimizer: float) -> dict[str, float]:
    """Parameters, gradients and ``optimizer`` bytes per parameter byte of each replica set, sharded by ZeRO."""
    memory = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
    for nbytes, d, _ in replicas:
        shard = {0: (1, 1, 1), 1: (1, 1, d), 2: (1, d, d), 3: (d, d, d)}[plan.zero]
        for key, per, s in zip(memory, (nbytes, nbytes, nbytes * optimizer), shard):
            memory[key] += per / s
    return memory


def price_mesh(plan: MeshPlan, model: GPTShape | Profile, topo: Topology, batch: int,
               efficiency: float = EFFICIENCY) -> Estimate:
    """The terms of the module docstring, in its order, for ``plan`` (see there for every formula); ``model``
    a GPT's shape or a CNN's profile."""
    if isinstance(model, Profile):
        return _price_cnn(plan, model, topo, batch)
    from labkit.parallel.megatron_cost import activation_bytes_per_layer

    gpt, step = model, MeshStep(plan, model, topo, batch)
    L, C, T = gpt.n_layer, gpt.n_embd, gpt.seq
    flops = 6 * gpt.active_params * batch * T + 12 * L * batch * T * T * C
    compute = flops / (plan.devices * topo.flops * efficiency) * (4 / 3 if plan.recompute else 1)
    time = {"compute": compute, "bubble": (plan.pp - 1) / plan.microbatches * compute}
    time.update((dim, price(step)) for dim, price in pricers().items())
    memory = _weights(plan, step.replicas, ADAM / E)
    b, s = step.b, step.tokens
    layer = activation_bytes_per_layer(b, s, C, gpt.n_head, plan.tp, plan.sequence_parallel, E)
    layer += max(0, gpt.top_k - 1) * 8 * b * s * C * E
    held = min(plan.pp, plan.microbatches) * step.layers
    memory["activations"] = held * b * s * C * E + layer if plan.recompute else held * layer
    return Estimate(plan, time, memory, topo.memory_bytes)


def _price_cnn(plan: MeshPlan, prof: Profile, topo: Topology, batch: int) -> Estimate:
    from labkit.strategies.pipeline_stages import even_balance

    stages = tuple(stages_of(even_balance(len(prof.layers), plan.pp)))
    cut = max((prof.layers[s[-1]].out_bytes for s in stages[:-1]), default=0)
    shape = GPTShape(len(prof.layers), 1, cut // 4, 0, 1, prof.model)
    step = CNNStep(plan, shape, topo, batch, 4, prof, stages)
    m, b = plan.microbatches, step.b
    compute = compute_scale(topo, plan.devices) * m * max(prof.time(b, s) for s in stages)
    time = {"compute": compute, "bubble": (plan.pp - 1) / m * compute}
    time.update((dim, price(step)) for dim, price in pricers().items())
    fullest = {}
    for s in stages:  # the stage with the most bytes sets the memory a device needs
        memory = memory_terms(prof, topo, 0.0, min(plan.pp, m) * prof.saved_bytes(b, s))
        memory.update(_weights(plan, [(prof.params(s), plan.dp, 1)], 1.0))
        fullest = max(fullest, memory, key=lambda x: sum(x.values(), 0.0))
    shard = plan.dp if plan.zero else 1  # ZeRO 1-3 step the optimizer over a shard
    time.update(common_terms(prof, topo, step.replicas[0][0] / shard, batch // plan.dp))
    return Estimate(plan, time, fullest, topo.memory_bytes)


def _valid(plan: MeshPlan, model: GPTShape | Profile, batch: int) -> bool:
    """What the dimensions accept: a CNN dp and pp (at most one stage per layer); a GPT's tp divides the heads, pp
    the blocks, 2·cp the sequence (zig-zag), cp and pp not together, ep the experts (a MoE takes only dp and ep),
    SP only with tp; ``dp·ep·m`` divides the batch, ``m ≥ pp`` with a pipeline (else 1), ZeRO only where ranks
    hold the same weights."""
    p = plan
    if isinstance(model, Profile):
        shape = p.tp == p.cp == p.ep == 1 and not p.sequence_parallel and not p.recompute and p.pp <= len(model.layers)
    else:
        g = model
        shape = ((p.tp == p.pp == p.cp == 1 and g.n_expert % p.ep == 0 if g.n_expert else p.ep == 1)
                 and g.n_head % p.tp == 0 and g.n_layer % p.pp == 0 and g.seq % (2 * p.cp) == 0
                 and not (p.cp > 1 and p.pp > 1) and (not p.sequence_parallel or p.tp > 1))
    return (shape and batch % (p.dp * p.ep * p.microbatches) == 0
            and (p.microbatches >= p.pp if p.pp > 1 else p.microbatches == 1) and (p.zero == 0 or p.dp * p.cp * p.ep > 1))


def meshes(devices: int, model: GPTShape | Profile, batch: int) -> list[MeshPlan]:
    """Every valid plan using all ``devices``: ``dp·tp·pp·cp·ep = N`` over its divisors."""
    out = []
    divisors = [k for k in range(1, devices + 1) if devices % k == 0]
    for tp, pp, cp, ep in itertools.product(divisors, repeat=4):
        if devices % (tp * pp * cp * ep):
            continue
        dp = devices // (tp * pp * cp * ep)
        for m, zero, sp, rc in itertools.product(MICROBATCHES, range(4), (False, True), (False, True)):
            plan = MeshPlan(dp, tp, pp, cp, m, zero, sp, rc, ep)
            if _valid(plan, model, batch):
                out.append(plan)
    return out


def _key(e: Estimate) -> tuple:
    return (not e.feasible, e.step_s, e.peak_bytes, e.plan.label)


def search(model: GPTShape | Profile, topo: Topology, batch: int, devices: int | None = None) -> list[Estimate]:
    """Every plan of :func:`meshes` priced, best first (plans that do not fit last)."""
    return sorted((price_mesh(p, model, topo, batch) for p in meshes(devices or topo.ranks, model, batch)), key=_key)


def frontier(estimates: list[Estimate]) -> list[Estimate]:
    """The feasible plans no other beats on both step time and memory (fastest first)."""
    out: list[Estimate] = []
    for e in sorted((e for e in estimates if e.feasible), key=_key):
        if not out or e.peak_bytes < out[-1].peak_bytes:
            out.append(e)
    return out


def size(nbytes: float) -> str:
    """``12 GB`` at a gigabyte or more, else ``3.4 MB``."""
    return f"{nbytes / GB:.0f} GB" if nbytes >= GB else f"{nbytes / MB:.1f} MB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2g} ms"


def explain(estimates: list[Estimate], model: GPTShape | Profile, topo: Topology) -> str:
    """Why the best plan wins, in words: the faster plan that does not fit (if one is faster), then against
    the best plan of each of the next mesh shapes, the term that decides, or the memory that rules it out."""
    what = (f"{model.model} on {model.dataset}" if isinstance(model, Profile)
            else f"a {model.name} GPT at sequence {model.seq}")
    best, limit = estimates[0], size(topo.memory_bytes)
    if not best.feasible:
        return f"on {topo.name}, no plan for {what} fits in memory"
    seen, reasons = {_shape(best.plan)}, []
    fastest = min(estimates, key=lambda e: e.step_s)
    if not fastest.feasible:
        reasons.append(f"the faster {fastest.plan.label} ({ms(fastest.step_s)}) needs {size(fastest.peak_bytes)} "
                       f"per device (> {limit})")
    for e in estimates:
        if _shape(e.plan) in seen:
            continue
        seen.add(_shape(e.plan))
        if not e.feasible:
            reasons.append(f"{e.plan.label} needs {size(e.peak_bytes)} per device (> {limit})")
        else:
            term = max(e.time, key=lambda k: e.time[k] - best.time.get(k, 0.0))
            reasons.append(f"{e.plan.label} is {(e.step_s / best.step_s - 1):.0%} slower ({term} "
                           f"{ms(e.time[term])} against {ms(best.time.get(term, 0.0))})")
        if len(reasons) >= 3:
            break
    return (f"on {topo.name}, {what}: {best.plan.label} ({ms(best.step_s)}/step, {size(best.peak_bytes)} per "
            "device) because " + ("; ".join(reasons) or "it is the only mesh"))


def _shape(plan: MeshPlan) -> tuple:
    return plan.dp, plan.tp, plan.pp, plan.cp, plan.ep

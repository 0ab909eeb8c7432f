"""What a plan on a device mesh costs (:class:`labkit.advisor.plan.MeshPlan`: ``dp×tp×pp×cp×ep`` with micro-batches,
ZeRO stage, sequence parallelism, recomputation), for the advisor's mesh search (:func:`labkit.advisor.search.mesh_candidates`):
pure formulas beside the dimensions that price their own terms, and the GPT shapes they read (:class:`GPTShape`).

A plan's step on ``N = dp·tp·pp·cp·ep`` devices, global batch ``B``, ``m`` micro-batches of ``b = B/(dp·ep·m)``
samples per pipeline column, terms in this order:

* ``compute``: a GPT's ``(6·P_a·B·T + 12·L·B·T²·C) / (N·F·η)`` (Narayanan et al. 2021: the matrix products and
  attention's scores, forward and backward, for sequences of ``T`` tokens; ``P_a`` the parameters a token
  passes, a MoE's ``k`` experts of ``E``; ``F`` the device's peak FLOP/s at efficiency ``η``, an assumption,
  :data:`EFFICIENCY`), ``× 4/3`` with recomputation (the forward again); a CNN's ``s·m·max_j T_j(b)`` from
  its profile (stage ``j``'s layers as ``labkit train --mesh`` cuts them, evenly; ``s`` the topology's
  :func:`~labkit.advisor.topology.compute_scale`);
* ``bubble = idle/m · compute``, ``idle`` one rank's idle time per micro-batch's work of the plan's pipeline
  schedule (``MeshPlan.schedule``, 1F1B unless set), simulated from its action lists at ``t_F = t_B = t_W``
  (:func:`labkit.parallel.pp_simulate.unit_step`): ``pp − 1`` for GPipe and 1F1B, ``(pp − 1)/3`` for ZB-H1,
  ``(pp − 1)/v`` interleaved;
* one term per mesh dimension, priced by the function its module's ``ADVISOR`` literal names, beside its
  ``FLAGS`` (:func:`labkit.parallel.registered`): ``tp``, ``cp``, ``ep``, ``pp``, ``dp``, each reading a
  :class:`MeshStep`. A CNN enters them as a model of one token per sample whose stage boundary carries its
  widest cut's activation and which ties no embedding (:class:`CNNStep`). Nothing overlaps with compute;
* a CNN also pays :func:`~labkit.advisor.topology.common_terms` (``update`` of its shard, ``data``).

Each collective uses the link its group spans (:meth:`labkit.advisor.topology.Topology.link_of`): ranks
are laid out ``pp, dp, cp, tp`` (``dp, ep`` for a MoE) with the last innermost, so a group of size ``g`` and
stride ``s`` spans ``g·s`` ranks. Memory per device: a GPT's is
:func:`labkit.parallel.memory.predict_memory` (the one memory model: its terms at the moment of the step where
they peak, in mixed precision with Adam, 2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2020; ZeRO 1 sharding
the optimizer over the ``d`` ranks holding the same weights, 2 also the gradients, 3 all three; the activations of
the micro-batches in flight, the same simulation's peak: 1F1B's ``min(pp, m)``, ZB-H1's ``pp``, GPipe's ``m``; a
MoE's ``k`` experts add ``(k − 1)·8·bTC`` elements per block); a CNN's, in fp32 with momentum (4 + 4 + 4, sharded
by :func:`labkit.parallel.memory.weight_bytes`), the saved bytes of its fullest stage.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from labkit.advisor.plan import Estimate, MeshPlan, Profile
from labkit.advisor.topology import Topology, common_terms, compute_scale, memory_terms, stages_of
from labkit.flags import resolve
from labkit.parallel.memory import predict_memory, weight_bytes

E = 2                #: bytes per element of a GPT's weights, activations and messages (bf16)
ADAM = 12            #: bytes per parameter of a GPT's optimizer: fp32 master copy, momentum, variance
EFFICIENCY = 0.4     #: share of the peak FLOP/s a training step reaches (an assumption, not measured)


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
        from labkit.models.gpt import GPTConfig

        return GPTConfig(self.vocab_size, self.seq, n_layer or self.n_layer, self.n_head, self.n_embd)


#: GPT-3's 1.3B shape (Brown et al. 2020) at sequence 4096, GPT-2's vocabulary padded to 50304
GPT_1_3B = GPTShape(24, 16, 2048, 50304, 4096, "1.3B")


def gpt_shape(model: str, seq: int | None = None) -> GPTShape:
    """``--model``'s GPT (``gpt-1.3b``, one of :data:`labkit.models.gpt.GPT_SIZES` or :data:`labkit.models.moe.MOE_SIZES` by its
    ``LANGUAGE_MODELS`` name) with GPT-2's vocabulary (50304) at sequence ``seq`` (default its block size)."""
    from labkit.errors import ConfigError
    from labkit.models.gpt import GPT_SIZES
    from labkit.models.moe import MOE_SIZES
    from labkit.models.names import LANGUAGE_MODELS

    if model == "gpt-1.3b":
        return GPTShape(**{**GPT_1_3B.__dict__, "seq": seq or GPT_1_3B.seq})
    cfg, moe = MOE_SIZES.get(model, (GPT_SIZES.get(LANGUAGE_MODELS.get(model, "")), None))
    if cfg is None:
        raise ConfigError(f"the mesh search prices a dense GPT: gpt-1.3b or {', '.join(GPT_SIZES)}, or a mixture of "
                          f"experts: {', '.join(MOE_SIZES)}; not {model!r}")
    experts = (moe.n_expert, moe.top_k) if moe else (0, 0)
    return GPTShape(cfg.n_layer, cfg.n_head, cfg.n_embd, 50304, seq or cfg.block_size, model, *experts)


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

    return {dim: resolve(entry["price"]) for dim, entry in registered("ADVISOR").items()}


def pipeline_step(plan: MeshPlan) -> tuple[float, float]:
    """``(idle, held)``: the plan's pipeline schedule simulated (:func:`labkit.parallel.pp_simulate.unit_step`), one
    rank's idle time in micro-batches' work and the peak of micro-batches in flight (1 without a pipeline)."""
    from labkit.parallel.pp_simulate import unit_step

    if plan.pp == 1:
        return 0.0, 1.0
    idle, peak = unit_step(plan.schedule, plan.pp, plan.microbatches, plan.virtual)
    return float(idle), float(peak)


def price_mesh(plan: MeshPlan, model: GPTShape | Profile, topo: Topology, batch: int,
               efficiency: float = EFFICIENCY) -> Estimate:
    """The terms of the module docstring, in its order, for ``plan`` (see there for every formula); ``model``
    a GPT's shape or a CNN's profile."""
    if isinstance(model, Profile):
        return _price_cnn(plan, model, topo, batch)
    gpt, step = model, MeshStep(plan, model, topo, batch)
    L, C, T = gpt.n_layer, gpt.n_embd, gpt.seq
    flops = 6 * gpt.active_params * batch * T + 12 * L * batch * T * T * C
    compute = flops / (plan.devices * topo.flops * efficiency) * (4 / 3 if plan.recompute else 1)
    idle, held = pipeline_step(plan)
    time = {"compute": compute, "bubble": idle / plan.microbatches * compute}
    time.update((dim, price(step)) for dim, price in pricers().items())
    b, s = step.b, step.tokens
    memory = predict_memory(gpt, step.b, dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, zero=plan.zero,
                            sequence_parallel=plan.sequence_parallel, recompute=plan.recompute, in_flight=held,
                            replicas=[(nbytes / E, d) for nbytes, d, _ in step.replicas], param_bytes=E,
                            grad_bytes=E, optimizer_bytes=ADAM, e=E,
                            extra_layer_bytes=max(0, gpt.top_k - 1) * 8 * b * s * C * E)
    return Estimate(plan, time, dict(memory["at_peak"]), topo.memory_bytes)


def _price_cnn(plan: MeshPlan, prof: Profile, topo: Topology, batch: int) -> Estimate:
    from labkit.parallel.pipeline_stages import even_balance

    stages = tuple(stages_of(even_balance(len(prof.layers), plan.pp)))
    cut = max((prof.layers[s[-1]].out_bytes for s in stages[:-1]), default=0)
    shape = GPTShape(len(prof.layers), 1, cut // 4, 0, 1, prof.model)
    step = CNNStep(plan, shape, topo, batch, 4, prof, stages)
    m, b = plan.microbatches, step.b
    compute = compute_scale(topo, plan.devices) * m * max(prof.time(b, s) for s in stages)
    idle, held = pipeline_step(plan)
    time = {"compute": compute, "bubble": idle / m * compute}
    time.update((dim, price(step)) for dim, price in pricers().items())
    fullest = {}
    for s in stages:  # the stage with the most bytes sets the memory a device needs
        memory = memory_terms(prof, topo, 0.0, held * prof.saved_bytes(b, s))
        memory.update(weight_bytes([(prof.params(s), plan.dp)], plan.zero, 1, 1, 1))
        fullest = max(fullest, memory, key=lambda x: sum(x.values(), 0.0))
    shard = plan.dp if plan.zero else 1  # ZeRO 1-3 step the optimizer over a shard
    time.update(common_terms(prof, topo, step.replicas[0][0] / shard, batch // plan.dp))
    return Estimate(plan, time, fullest, topo.memory_bytes)

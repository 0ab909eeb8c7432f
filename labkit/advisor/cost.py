"""The cost model: one pricing function per strategy, each term named and written as its formula.

Notation (per optimizer step, global batch ``B``):

* ``T_k(b)`` forward + backward seconds of layer ``k`` on ``b`` samples (profile, fitted ``a + c·b``);
  ``T_S(b) = Σ_{k∈S} T_k(b)``; ``s`` = oversubscription × device speed of the topology;
* on one CPU, work is conserved: ``q`` processes sharing ``c`` cores cannot do one-thread work ``W`` in less
  than ``W / min(q, c)`` (:func:`cpu_floor`), so ``q`` ranks on ``c`` cores are never priced more than ``c``
  times faster than one process;
* ``P`` parameter bytes (``P_S`` of layers ``S``); ``A_k`` output bytes of layer ``k`` per sample;
  ``M_S(b)`` bytes autograd saves in layers ``S`` for ``b`` samples;
* ``AR(n, algo, p)`` the all-reduce of ``n`` bytes over ``p`` ranks priced from the kit's schedule counts:
  ``Σ_steps α·m_s + β·b_s + γ·r_s`` (:meth:`labkit.collectives.cost.CostModel.predict`);
  ``msg(n) = α + β·n`` one point-to-point message; α, β and γ are the topology's, measured once
  (:mod:`labkit.advisor.measure`) or from a public specification, the same for every strategy;
* ``u`` optimizer seconds per parameter byte, ``d`` loading seconds per sample (measured by the profile;
  the loss is inside ``T``, which the profile scales to whole measured bare steps).

Every plan pays ``update = u·P_dev``, ``data = d·(samples its rank loads)`` and the loop's ``bookkeeping`` per step
(measured by the profile; added by :func:`labkit.advisor.pricing.price`); the loop's stop check costs nothing
per step (one tiny non-blocking all-reduce every few tenths of a second) and is not priced. Memory on
the fullest device: ``parameters + gradients + optimizer (momentum) = 3·P_dev``, ``activations``,
``buffers`` (communication copies), ``runtime`` (a process before any model; CPU only).
"""
from __future__ import annotations

import math

from labkit.advisor.plan import Estimate, Plan
from labkit.advisor.profile import Profile
from labkit.advisor.topology import Topology
from labkit.collectives.cost import CostModel
from labkit.collectives.registry import get_schedule

BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default, also labkit's --bucket-mb
FIRST_BUCKET_BYTES = 2**20  # DistributedDataParallel's first bucket (the last layers' gradients) is capped lower


def allreduce_time(nbytes: float, ranks: int, algorithm: str, topo: Topology) -> float:
    """``AR(n, algo, p)``: the schedule's per-step counts priced by the α-β-γ link (0 for one rank).

    ``ddp`` (PyTorch's DistributedDataParallel over gloo/NCCL) and ``native`` (``dist.all_reduce``) are
    priced as the ring schedule, the algorithm those libraries use for large messages.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    name = "ring" if algorithm in ("ddp", "native") else algorithm
    return topo.collective_link(ranks).predict(get_schedule(name, ranks), math.ceil(nbytes / 4), 4)


def ring_bytes_time(nbytes: float, ranks: int, link: CostModel) -> float:
    """The bytes part of a ring all-reduce of ``n`` bytes: ``2(p − 1)/p·n·β + (p − 1)/p·n·γ`` (no α)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return CostModel(0.0, link.beta, link.gamma).predict(get_schedule("ring", ranks), math.ceil(nbytes / 4), 4)


def message_time(nbytes: float, topo: Topology, ranks: int = 2) -> float:
    """``msg(n) = α + β·n``: one point-to-point message."""
    return topo.collective_link(ranks).transfer_time(nbytes)


def bucketed_allreduce(nbytes: float, ranks: int, algorithm: str, topo: Topology) -> float:
    """``Σ_buckets AR(bucket, algo, p)``: gradients leave in buckets of at most 25 MB; PyTorch's DDP
    (``algo = ddp``) caps its first bucket at 1 MB, so a model over 1 MB pays at least two all-reduces."""
    first = min(nbytes, FIRST_BUCKET_BYTES) if algorithm == "ddp" else 0.0
    full, rest = divmod(nbytes - first, BUCKET_BYTES)
    return (allreduce_time(first, ranks, algorithm, topo) + full * allreduce_time(BUCKET_BYTES, ranks, algorithm, topo)
            + allreduce_time(rest, ranks, algorithm, topo))


def bucket_count(nbytes: float, algorithm: str) -> int:
    """How many all-reduces :func:`bucketed_allreduce` launches for ``nbytes`` of gradients."""
    first = min(nbytes, FIRST_BUCKET_BYTES) if algorithm == "ddp" else 0.0
    full, rest = divmod(nbytes - first, BUCKET_BYTES)
    return int(first > 0) + int(full) + int(rest > 0)


def broadcast_time(count: int, nbytes: float, ranks: int, topo: Topology) -> float:
    """``BC(k, n) = (p − 1)·(k·α + β·n)``: ``k`` broadcasts of ``n`` bytes in all, the root sending to
    each rank."""
    if ranks <= 1 or count == 0:
        return 0.0
    link = topo.collective_link(ranks)
    return (ranks - 1) * (count * link.alpha + link.beta * nbytes)


def common_terms(prof: Profile, topo: Topology, params: float, loaded: float) -> dict[str, float]:
    return {"update": prof.update_s_per_byte * params * topo.compute_scale, "data": prof.data_s_per_sample * loaded}


def memory_terms(prof: Profile, topo: Topology, params: float, activations: float,
                 buffers: float = 0.0) -> dict[str, float]:
    return {"parameters": params, "gradients": params, "optimizer": params, "activations": activations,
            "buffers": buffers, "runtime": prof.base_bytes if topo.device == "cpu" else 0.0}


def compute_scale(topo: Topology, processes: int) -> float:
    return topo.oversubscription(processes) * topo.compute_scale


def price_single(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """One device: ``compute = s·T_all(B)``; memory ``3P + M_all(B)``."""
    B = plan.batch_size
    time = {"compute": compute_scale(topo, 1) * prof.time(B), **common_terms(prof, topo, prof.param_bytes, B)}
    return Estimate(plan, time, memory_terms(prof, topo, prof.param_bytes, prof.saved_bytes(B)))


def price_ddp(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """Data parallel over ``p`` ranks, each ``b = B/p`` samples:

    ``compute = s·T_all(b)``; ``communication = Σ_buckets AR(bucket, algo, p)`` after backward (no overlap
    is assumed: small models fit one or two buckets, ready only near the end of backward) ``+ BC(1, n_buf)``
    under PyTorch's DDP, which broadcasts the model's buffers (``n_buf`` bytes, coalesced) from rank 0 in
    every forward; memory ``3P + M_all(b) + P`` (the flat gradient bucket).
    """
    p, b = plan.processes, plan.batch_size / plan.processes
    algo = plan.option.get("allreduce", "ddp")
    count, nbytes = prof.buffers
    sync = broadcast_time(1, nbytes, p, topo) if algo == "ddp" and count else 0.0
    time = {"compute": compute_scale(topo, p) * prof.time(b),
            "communication": bucketed_allreduce(prof.param_bytes, p, algo, topo) + sync,
            **common_terms(prof, topo, prof.param_bytes, b)}
    return Estimate(plan, time, memory_terms(prof, topo, prof.param_bytes, prof.saved_bytes(b), prof.param_bytes))


def price_hybrid(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """Seed 000's placement: features ``F`` data parallel on ``p`` ranks (``b = B/p``), classifier ``C`` on rank 0.

    Rank 0's step: ``compute = s·(T_F(b) + T_C(B))``; ``communication = 2(p−1)·msg(b·A_F)`` (gather the
    features, scatter their gradients) ``+ (p−1)·msg(b·classes·4)`` (logits back) ``+ AR(P_F, ring, p)``;
    memory ``3P + M_F(b) + M_C(B) + 2·B·A_F + P_F`` (gathered features and their gradient, flat grads).
    """
    if prof.feature_layers is None:
        return Estimate(plan, note="needs a model with .features and .classifier (alexnet_small)")
    p, B = plan.processes, plan.batch_size
    b = B / p
    F, C = range(prof.feature_layers), range(prof.feature_layers, len(prof.layers))
    feat = prof.layers[prof.feature_layers - 1].out_bytes
    logits = prof.layers[-1].out_bytes
    comm = (2 * (p - 1) * message_time(b * feat, topo, p) + (p - 1) * message_time(b * logits, topo, p)
            + allreduce_time(prof.params(F), p, "ring", topo))
    time = {"compute": compute_scale(topo, p) * (prof.time(b, F) + prof.time(B, C)), "communication": comm,
            **common_terms(prof, topo, prof.param_bytes, b)}
    memory = memory_terms(prof, topo, prof.param_bytes, prof.saved_bytes(b, F) + prof.saved_bytes(B, C),
                     2 * B * feat + prof.params(F))
    return Estimate(plan, time, memory)


def price_tensor_parallel(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """Column/row pairs of Linears sliced over ``p`` ranks; every rank runs the whole batch ``B``.

    Sliced layers ``S`` (each pair and the elementwise layers between) cost ``T_k(B/p)``, the rest
    ``T_k(B)``: ``compute = s·(T_rest(B) + Σ_{k∈S} T_k(B/p))``. Per pair (column i, row j):
    ``communication = AR(B·A_{i−1}, ring, p)`` (backward, input gradient) ``+ AR(B·A_j, ring, p)``
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
    comm = sum(allreduce_time(B * a, p, "ring", topo) + allreduce_time(B * prof.layers[j].out_bytes, p, "ring", topo)
               for a, (_, j) in zip(inputs, prof.tp_pairs))
    p_sliced = sum(prof.layers[k].param_bytes for k in sliced)
    p_dev = prof.param_bytes - (1 - 1 / p) * p_sliced
    time = {"compute": compute_scale(topo, p) * compute, "communication": comm, **common_terms(prof, topo, p_dev, B)}
    acts = sum(prof.layers[k].saved_bytes for k in rest) * B + sum(prof.layers[k].saved_bytes for k in sliced) * B / p
    return Estimate(plan, time, memory_terms(prof, topo, p_dev, acts))


def stages_of(balance) -> list[range]:
    """Layer index ranges of the stages: ``[3, 2] -> [range(0, 3), range(3, 5)]``."""
    start, out = 0, []
    for n in balance:
        out.append(range(start, start + n))
        start += n
    return out


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a fill-and-drain pipeline step: ``(p − 1) / (m + p − 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_terms(stage_times: list[float], stage_comm: list[float], microbatches: int,
                   overhead: float = 0.0, critical_path: bool = False) -> dict[str, float]:
    """A fill-and-drain step over ``p`` stages of measured times ``t_j`` (per micro-batch) and outgoing
    messages ``c_j``. A stage's slot is ``τ_j = t_j + h + c_j``; the slowest, ``τ = τ_{j*}``, sets the pace.

    The textbook count (default): the step takes ``(m + p − 1)·τ``: ``compute = m·t_{j*}``,
    ``communication = m·c_{j*}``, ``bubble = (p − 1)·τ`` — the bubble is ``(p − 1)/(m + p − 1)`` of the step.

    ``critical_path=True``: the step's critical path when the stages differ. The forwards are a flow shop: the
    first micro-batch crosses every stage once, the others follow at the slowest stage's pace, so they end
    after ``Σ_j f_j + (m − 1)·max_j f_j``; the backwards, which start when the last forward is done, alike. With
    ``j*`` the slowest stage both ways, the step is ``m·τ + Σ_{j≠j*} τ_j``: ``bubble = Σ_{j≠j*} τ_j``, each
    other stage crossed once on the way in and once on the way out at its own pace. Equal stages give the
    textbook's ``(p − 1)·τ``; a light stage beside a heavy one costs its own time, not the heavy one's.
    Measured on 2 gloo ranks, 3 rounds, LeNet at ``m = 2``: cut ``[5, 7]`` (stages 2.0–2.3 and 0.5–0.6 ms per
    micro-batch) the textbook count alone came to more than the measured step (what was left for the
    schedule's own price ``h`` per slot: −0.31 to −0.46 ms), the critical path left 0.23–0.36 ms, as the
    balanced cut ``[3, 9]`` did (0.34–0.45 ms).

    ``h`` (``overhead``) is what the pipeline's runtime spends per micro-batch on every stage; when given,
    ``schedule overhead = m·h`` is a term of its own.
    """
    p, m = len(stage_times), microbatches
    slots = [t + overhead + c for t, c in zip(stage_times, stage_comm)]
    j = max(range(p), key=lambda k: slots[k])
    bubble = sum(slots[k] for k in range(p) if k != j) if critical_path else (p - 1) * slots[j]
    terms = {"compute": m * stage_times[j], "communication": m * stage_comm[j], "bubble": bubble}
    if overhead:
        terms["schedule overhead"] = m * overhead
    return terms


def price_pipeline(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """One stage per rank (``torch.distributed.pipelining``), ``m`` micro-batches of ``B/m``:

    ``t_j = s·T_{stage j}(B/m)``, ``c_j = 2·msg((B/m)·A_{last of j})`` (activation forward, gradient
    backward; 0 for the last stage), terms from :func:`pipeline_terms` along the critical path (the stages a
    search cuts are seldom equal).
    Every rank loads the whole batch.
    Memory of stage ``j``: ``3·P_j + k_j·M_j(B/m)`` with ``k_j = m`` (gpipe schedule) or
    ``min(p − j, m)`` (1f1b); the fullest stage counts.
    """
    o = plan.option
    p, m, B = plan.processes, o["num_microbatches"], plan.batch_size
    stages = stages_of(o["balance"])
    bm = B / m
    msg = topo.collective_link(p).transfer_time
    times = [compute_scale(topo, p) * prof.time(bm, s) for s in stages]
    comm = [2 * msg(bm * prof.layers[s[-1]].out_bytes) if j < p - 1 else 0.0 for j, s in enumerate(stages)]
    held = [m if o.get("schedule", "gpipe") == "gpipe" else min(p - j, m) for j in range(p)]
    mem = [memory_terms(prof, topo, prof.params(s), held[j] * prof.saved_bytes(bm, s)) for j, s in enumerate(stages)]
    full = max(range(p), key=lambda j: sum(mem[j].values()))
    time = pipeline_terms(times, comm, m, critical_path=True)
    time.update(common_terms(prof, topo, max(prof.params(s) for s in stages), B))
    return Estimate(plan, time, mem[full])


def price_one_process_pipeline(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """``gpipe`` (torchgpipe) and ``model-parallel``: one process drives ``k`` partitions, ``m`` micro-batches.

    On separate devices (GPUs) the partitions overlap as in :func:`pipeline_terms` (copies between devices
    priced as messages). On one CPU they share the cores, so nothing overlaps: ``compute = s·m·T_all(B/m)``
    and there is no bubble to speak of. GPipe's checkpointing (``except_last``) runs the forward again for
    all but the last micro-batch: ``recompute = s·(m − 1)·Σ_k fwd_k(B/m)``. GPipe also orders its
    micro-batches by joining each one's input with the previous one's output, so the first layer computes a
    gradient for the input of every micro-batch but the first: ``input gradient = s·(m − 1)·g_0(B/m)``
    (:meth:`labkit.advisor.profile.Profile.input_grad_time`; on separate devices part of stage 0's time).
    torchgpipe's own work per micro-batch and partition, ``h_g`` (:class:`labkit.advisor.profile.Profile`'s
    ``gpipe_task``), is ``schedule overhead = m·k·h_g`` on one CPU (one thread runs every task); on separate
    devices every stage's time per micro-batch includes it and the slowest stage's ``m·h_g`` is the term.
    Memory ``3P + M_all(B)`` (model-parallel, gpipe without checkpointing), or with checkpointing
    ``3P + M_all(B/m) + Σ_j m·(B/m)·A_{input of j}`` (each partition keeps only its inputs).
    """
    o = plan.option
    B, k = plan.batch_size, plan.devices
    m = o.get("num_microbatches") or (B // o["mp_split_size"] if o.get("mp_split_size") else 1)
    bm = B / m
    balance = o.get("balance") or _split_balance(o.get("mp_split_points", ()), len(prof.layers))
    stages = stages_of(balance)
    s = compute_scale(topo, 1)
    gpipe = plan.strategy == "gpipe" and m > 1  # torchgpipe, checkpointing except_last (what plans run)
    input_grad = s * (m - 1) * prof.input_grad_time(bm) if gpipe else 0.0
    task = prof.gpipe_task if plan.strategy == "gpipe" else 0.0
    if topo.separate_devices:
        times = [s * prof.time(bm, st) + (input_grad / m if j == 0 else 0.0) for j, st in enumerate(stages)]
        comm = [2 * message_time(bm * prof.layers[st[-1]].out_bytes, topo) if j < k - 1 else 0.0
                for j, st in enumerate(stages)]
        time = pipeline_terms(times, comm, m, task, critical_path=True)
    else:
        time = {"compute": s * m * prof.time(bm)}
        if input_grad:
            time["input gradient"] = input_grad
        if task:
            time["schedule overhead"] = m * k * task
    if gpipe:
        time["recompute"] = s * (m - 1) * sum(layer.forward_time(bm) for layer in prof.layers)
        inputs = sum(prof.layers[st[0] - 1].out_bytes if st[0] else prof.input_bytes for st in stages)
        acts = prof.saved_bytes(bm) + B * inputs
    else:
        acts = prof.saved_bytes(B)
    time.update(common_terms(prof, topo, prof.param_bytes, B))
    return Estimate(plan, time, memory_terms(prof, topo, prof.param_bytes, acts))


def _split_balance(points, n: int) -> list[int]:
    bounds = [0, *points, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]

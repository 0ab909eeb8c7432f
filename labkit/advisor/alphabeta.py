"""The prices every strategy pays, the same for all: the α-β-γ link, the CPU's work conservation, the pipeline.

Notation of every pricing function (each lives beside its strategy's ``FLAGS``, in ``labkit/strategies/`` and
``labkit/parallel/``), per optimizer step, global batch ``B``:

* ``T_k(b)`` forward + backward seconds of layer ``k`` on ``b`` samples (profile, fitted ``a + c·b``);
  ``T_S(b) = Σ_{k∈S} T_k(b)``; ``s`` = oversubscription × device speed × the measured slowdown of processes computing at once
  (:func:`compute_scale`), the same for every plan of as many processes;
* ``P`` parameter bytes (``P_S`` of layers ``S``); ``A_k`` output bytes of layer ``k`` per sample;
  ``M_S(b)`` bytes autograd saves in layers ``S`` for ``b`` samples;
* ``AR(n, algo, p)`` the all-reduce of ``n`` bytes over ``p`` ranks priced from the kit's schedule counts:
  ``Σ_steps α·m_s + β·b_s + γ·r_s`` (:meth:`labkit.collectives.cost.CostModel.predict`);
  ``msg(n) = α + β·n`` one point-to-point message; ``C_kind(n, p)`` one of PyTorch's collectives
  (:func:`collective_time`); α, β and γ are the topology's, per kind of collective, measured once
  (:mod:`labkit.advisor.measure`) or from a public specification;
* ``u`` optimizer seconds per parameter byte, ``d`` loading seconds per sample (measured by the profile).

Every plan pays ``update = u·P_dev`` and ``data = d·(samples its rank loads)`` (:func:`common_terms`). Memory on
the fullest device (:func:`memory_terms`): ``parameters + gradients + optimizer (momentum) = 3·P_dev``,
``activations``, ``buffers`` (communication copies), ``runtime`` (a process before any model; CPU only).
Pure functions: no torch, no timing, no I/O.
"""
from __future__ import annotations

import math

from labkit.collectives.registry import get_schedule

BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default, also labkit's --bucket-mb
FIRST_BUCKET_BYTES = 2**20  # DistributedDataParallel's first bucket (the last layers' gradients) is capped lower


#: the kinds of collective the link fit prices apart (:mod:`labkit.advisor.measure`): one point-to-point ring
#: step (the kit's own schedules, pipeline and parameter-server messages) and PyTorch's own collectives
KINDS = ("p2p", "all_reduce", "reduce_scatter", "all_gather", "broadcast")


def ring_counts(kind: str, ranks: int) -> tuple[float, float]:
    """``(messages, share)``: the messages one rank sends in a collective of ``kind`` over ``p`` ranks and the
    bytes it sends per byte of the buffer, as the ring algorithm (a flat broadcast: the root sends to each rank)
    makes them: ``p2p`` ``(1, 1)``; ``all_reduce`` ``(2(p − 1), 2(p − 1)/p)``; ``reduce_scatter`` and
    ``all_gather`` ``(p − 1, (p − 1)/p)``; ``broadcast`` ``(p − 1, p − 1)``."""
    p = ranks
    return {"p2p": (1, 1), "all_reduce": (2 * (p - 1), 2 * (p - 1) / p), "reduce_scatter": (p - 1, (p - 1) / p),
            "all_gather": (p - 1, (p - 1) / p), "broadcast": (p - 1, p - 1)}[kind]


def collective_time(kind: str, nbytes: float, ranks: int, topo, count: int = 1) -> float:
    """``k·C_kind(n, p) = k·(m·α + s·n·β)``: ``count = k`` collectives of ``kind``, each of an ``n``-byte buffer
    over ``p`` ranks, ``(m, s)`` = :func:`ring_counts`, α and β that kind's (:meth:`Topology.link_of`); 0 on one
    rank."""
    if ranks <= 1 or count == 0:
        return 0.0
    link = topo.link_of(kind, ranks)
    messages, share = ring_counts(kind, ranks)
    return count * (messages * link.alpha + share * nbytes * link.beta)


def allreduce_time(nbytes: float, ranks: int, algorithm: str, topo) -> float:
    """``AR(n, algo, p)``: PyTorch's (``ddp``, ``native``) is ``C_all_reduce(n, p)``; the kit's own algorithms
    are their schedule's per-step counts priced by the point-to-point link (0 for one rank)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if algorithm in ("ddp", "native"):
        return collective_time("all_reduce", nbytes, ranks, topo)
    return topo.link_of("p2p", ranks).predict(get_schedule(algorithm, ranks), math.ceil(nbytes / 4), 4)


def message_time(nbytes: float, topo, ranks: int = 2) -> float:
    """``msg(n) = α + β·n``: one point-to-point message."""
    return topo.link_of("p2p", ranks).transfer_time(nbytes)


def bucketed_allreduce(nbytes: float, ranks: int, algorithm: str, topo) -> float:
    """``Σ_buckets AR(bucket, algo, p)``: buckets of at most 25 MB; PyTorch's DDP (``algo = ddp``) caps its
    first bucket at 1 MB, so a model over 1 MB pays at least two all-reduces."""
    first = min(nbytes, FIRST_BUCKET_BYTES) if algorithm == "ddp" else 0.0
    full, rest = divmod(nbytes - first, BUCKET_BYTES)
    return (allreduce_time(first, ranks, algorithm, topo) + full * allreduce_time(BUCKET_BYTES, ranks, algorithm, topo)
            + allreduce_time(rest, ranks, algorithm, topo))


def broadcast_time(count: int, nbytes: float, ranks: int, topo) -> float:
    """``BC(k, n) = (p − 1)·(k·α + β·n)``: ``k`` broadcasts of ``n`` bytes in all, the root sending to each rank
    (``k·C_broadcast(n/k, p)``)."""
    return collective_time("broadcast", nbytes / count, ranks, topo, count) if count else 0.0


def compute_scale(topo, processes: int, prof=None) -> float:
    """``s = over(q) · device · κ_q``: how much slower each of ``q = processes`` computes than the profile's one
    process alone: oversubscription (``q / c`` where processes outnumber cores), device speed, and on a CPU
    ``κ_q = 1 + (κ − 1)·(min(q, n) − 1)/(n − 1)``, the measured slowdown of each of ``n = c // threads``
    processes computing at once (``prof.concurrency``; κ_1 = 1: one process computes alone)."""
    s = topo.oversubscription(processes) * topo.compute_scale
    n = topo.cores // prof.threads if prof is not None and topo.device == "cpu" else 1
    if n > 1 and processes > 1:
        s *= 1 + (prof.concurrency - 1) * (min(processes, n) - 1) / (n - 1)
    return s


def common_terms(prof, topo, params: float, loaded: float) -> dict[str, float]:
    """``update = u·P_dev·device speed``, ``data = d·samples loaded``."""
    return {"update": prof.update_s_per_byte * params * topo.compute_scale, "data": prof.data_s_per_sample * loaded}


def memory_terms(prof, topo, params: float, activations: float, buffers: float = 0.0) -> dict[str, float]:
    """``3·P_dev`` (parameters, gradients, momentum) ``+ activations + buffers (+ runtime on a CPU)``."""
    return {"parameters": params, "gradients": params, "optimizer": params, "activations": activations,
            "buffers": buffers, "runtime": prof.base_bytes if topo.device == "cpu" else 0.0}


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
                   critical_path: bool = False) -> dict[str, float]:
    """A fill-and-drain step over ``p`` stages of times ``t_j`` (per micro-batch) and outgoing messages ``c_j``.
    A stage's slot is ``τ_j = t_j + c_j``; the slowest, ``τ = τ_{j*}``, sets the pace:
    ``compute = m·t_{j*}``, ``communication = m·c_{j*}``, ``bubble = (p − 1)·τ`` (the textbook count: the
    bubble is ``(p − 1)/(m + p − 1)`` of the step), or with ``critical_path`` ``bubble = Σ_{j≠j*} τ_j`` (the
    first micro-batch crosses each other stage once each way at its own pace; equal stages give the textbook's
    count, a light stage beside a heavy one costs its own time).
    """
    p, m = len(stage_times), microbatches
    slots = [t + c for t, c in zip(stage_times, stage_comm)]
    j = max(range(p), key=lambda k: slots[k])
    bubble = sum(slots[k] for k in range(p) if k != j) if critical_path else (p - 1) * slots[j]
    return {"compute": m * stage_times[j], "communication": m * stage_comm[j], "bubble": bubble}

"""The prices every strategy pays alike (pure: no torch, no timing, no I/O), and the notation of every pricing
function beside a strategy's ``FLAGS``, per optimizer step of global batch ``B``:

* ``T_S(b)`` forward + backward seconds of layers ``S`` on ``b`` samples (the profile's ``a + c·b`` lines);
  ``s`` the compute scale of as many processes (:func:`compute_scale`);
* ``P`` parameter bytes (``P_S`` of layers ``S``); ``A_k`` output bytes of layer ``k`` per sample; ``M_S(b)``
  bytes autograd saves in layers ``S`` for ``b`` samples; ``u`` optimizer seconds per byte, ``d`` loading
  seconds per sample;
* ``AR(n, algo, p)`` an all-reduce of ``n`` bytes over ``p`` ranks (:func:`allreduce_time`), ``msg(n) = α + β·n``
  one message, ``C_kind(n, p)`` one of PyTorch's collectives (:func:`collective_time`), with the topology's α,
  β and γ per kind of collective (measured, or from a public specification).

Every plan pays ``update = u·P_dev`` and ``data = d·(samples its rank loads)`` (:func:`common_terms`) and holds
``3·P_dev`` (parameters, gradients, momentum) ``+ activations + buffers (+ runtime on a CPU)`` (:func:`memory_terms`).
"""
from __future__ import annotations

import itertools
import math

from labkit.collectives.registry import get_schedule

BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default, also labkit's --bucket-mb
FIRST_BUCKET_BYTES = 2**20  # DistributedDataParallel's first bucket (the last layers' gradients) is capped lower


#: the kinds of collective priced apart: a point-to-point ring step (the kit's schedules, pipeline and parameter
#: server messages) and PyTorch's own collectives
KINDS = ("p2p", "all_reduce", "reduce_scatter", "all_gather", "broadcast")


def ring_counts(kind: str, ranks: int) -> tuple[float, float]:
    """``(messages, share)`` one rank sends in a ring collective of ``kind`` over ``p`` ranks, per byte of the
    buffer: ``p2p (1, 1)``; ``all_reduce (2(p − 1), 2(p − 1)/p)``; ``reduce_scatter`` and ``all_gather``
    ``(p − 1, (p − 1)/p)``; ``broadcast`` (flat, the root sending to each) ``(p − 1, p − 1)``."""
    p = ranks
    return {"p2p": (1, 1), "all_reduce": (2 * (p - 1), 2 * (p - 1) / p), "reduce_scatter": (p - 1, (p - 1) / p),
            "all_gather": (p - 1, (p - 1) / p), "broadcast": (p - 1, p - 1)}[kind]


def collective_time(kind: str, nbytes: float, ranks: int, topo, count: int = 1) -> float:
    """``k·C_kind(n, p) = k·(m·α + s·n·β)``: ``k = count`` collectives of an ``n``-byte buffer over ``p`` ranks,
    ``(m, s)`` = :func:`ring_counts`, the kind's α and β; 0 on one rank."""
    if ranks <= 1 or count == 0:
        return 0.0
    link = topo.link_of(kind, ranks)
    messages, share = ring_counts(kind, ranks)
    return count * (messages * link.alpha + share * nbytes * link.beta)


def allreduce_time(nbytes: float, ranks: int, algorithm: str, topo) -> float:
    """``AR(n, algo, p)``: PyTorch's (``ddp``, ``native``) ``C_all_reduce(n, p)``; the kit's own, its schedule's
    ``Σ_steps α·m_s + β·b_s + γ·r_s`` on the point-to-point link; 0 on one rank."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if algorithm in ("ddp", "native"):
        return collective_time("all_reduce", nbytes, ranks, topo)
    return topo.link_of("p2p", ranks).predict(get_schedule(algorithm, ranks), math.ceil(nbytes / 4), 4)


def message_time(nbytes: float, topo, ranks: int = 2) -> float:
    """``msg(n) = α + β·n``: one point-to-point message."""
    return topo.link_of("p2p", ranks).transfer_time(nbytes)


def bucketed_allreduce(nbytes: float, ranks: int, algorithm: str, topo) -> float:
    """``Σ_buckets AR(bucket, algo, p)``: buckets of at most 25 MB, PyTorch's DDP's first one of 1 MB."""
    first = min(nbytes, FIRST_BUCKET_BYTES) if algorithm == "ddp" else 0.0
    full, rest = divmod(nbytes - first, BUCKET_BYTES)
    return (allreduce_time(first, ranks, algorithm, topo) + full * allreduce_time(BUCKET_BYTES, ranks, algorithm, topo)
            + allreduce_time(rest, ranks, algorithm, topo))


def broadcast_time(count: int, nbytes: float, ranks: int, topo) -> float:
    """``BC(k, n) = k·C_broadcast(n/k, p) = (p − 1)·(k·α + β·n)``: ``k`` broadcasts of ``n`` bytes in all."""
    return collective_time("broadcast", nbytes / count, ranks, topo, count) if count else 0.0


def compute_scale(topo, processes: int, prof=None) -> float:
    """``s = over(q) · device · κ_q``: how much slower each of ``q`` processes computes than the profile's one
    alone: oversubscription (``q / c`` past the cores), device speed, and on a CPU ``κ_q = 1 + (κ − 1)·(min(q, n)
    − 1)/(n − 1)`` with κ the measured slowdown of ``n = c // threads`` processes computing at once."""
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
    ends = list(itertools.accumulate(balance))
    return [range(end - n, end) for n, end in zip(balance, ends)]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a fill-and-drain pipeline step: ``(p − 1) / (m + p − 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_terms(stage_times: list[float], stage_comm: list[float], microbatches: int,
                   critical_path: bool = False) -> dict[str, float]:
    """A fill-and-drain step over ``p`` stages of times ``t_j`` and outgoing messages ``c_j`` per micro-batch,
    slots ``τ_j = t_j + c_j``, the slowest ``τ = τ_{j*}`` setting the pace: ``compute = m·t_{j*}``,
    ``communication = m·c_{j*}``, ``bubble = (p − 1)·τ`` (the textbook's ``(p − 1)/(m + p − 1)`` of the step), or
    with ``critical_path`` ``Σ_{j≠j*} τ_j`` (the first micro-batch crosses each other stage at its own pace)."""
    p, m = len(stage_times), microbatches
    slots = [t + c for t, c in zip(stage_times, stage_comm)]
    j = max(range(p), key=lambda k: slots[k])
    bubble = sum(slots[k] for k in range(p) if k != j) if critical_path else (p - 1) * slots[j]
    return {"compute": m * stage_times[j], "communication": m * stage_comm[j], "bubble": bubble}

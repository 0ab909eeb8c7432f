"""The device topology (seed 000's ``D = (D_N, D_E)``: :func:`labkit.advisor.measure.local_topology` gloo ranks, :data:`NAMED` GPU nodes) and
the prices every strategy pays on it alike (pure: no torch, timing or I/O), in the notation of the strategies' pricing
functions, per step of global batch ``B``: ``T_S(b)`` forward + backward seconds of layers ``S`` on ``b`` samples,
``M_S(b)`` the bytes autograd saves there; ``u`` optimizer seconds per byte, ``d`` loading seconds per sample; ``P``
parameter bytes (``P_S`` of layers ``S``), ``A_k`` output bytes of layer ``k`` per sample; a link's ``α`` seconds per
message, ``β`` per byte sent, ``γ`` per byte reduced; ``s``, ``msg``, ``AR``, ``C_kind`` and ``BC`` as defined below."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from labkit.collectives.cost import CostModel
from labkit.collectives.registry import get_schedule
from labkit.errors import ConfigError

GB, MB = 2**30, 2**20
#: kinds priced apart: a point-to-point ring step (the kit's schedules, pipeline and PS messages), PyTorch's collectives
KINDS = ("p2p", "all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class Topology:
    """Devices and links one job may use."""

    name: str
    ranks: int                         # processes (and devices)
    link: CostModel                    # α-β-γ inside a node
    memory_bytes: float                # usable per device (a CPU's shared by the ranks)
    device: str = "cpu"
    cores: int = 1                     # the CPU cores the ranks share
    nodes: int = 1
    inter: CostModel | None = None     # between nodes: what a collective over more ranks than a node holds pays
    separate_devices: bool = False     # one process's devices really run at once (GPUs, not one CPU)
    compute_scale: float = 1.0         # device speed against the profile (0.1: ten times faster)
    flops: float = 0.0                 # dense bf16 peak per device (0: unknown)
    kinds: dict = field(default_factory=dict)  # α-β per kind of collective where measured (others pay link)

    def threads(self, processes: int) -> int:
        """CPU threads per process when ``processes`` share the cores (at least one)."""
        return max(1, self.cores // processes) if self.device == "cpu" else 1

    def link_of(self, kind: str, ranks: int) -> CostModel:
        """The α-β of a ``kind`` collective over ``ranks`` consecutive ranks: ``inter`` past a node, else ``kinds``."""
        per_node = -(-self.ranks // self.nodes)
        return self.inter if self.inter is not None and ranks > per_node else self.kinds.get(kind, self.link)

    def with_memory(self, gigabytes: float | None) -> Topology:
        return self if gigabytes is None else replace(self, memory_bytes=gigabytes * GB)

    @classmethod
    def gpu_node(cls, gpus: int, link: CostModel, memory_gb: float = 80.0, compute_scale: float = 0.05, nodes: int = 1,
                 inter: CostModel | None = None, flops: float = 0.0, name: str | None = None) -> Topology:
        """``gpus`` GPUs per node on ``nodes`` nodes; the default ``compute_scale`` is a guess (profile on the GPU)."""
        return cls(name or f"{nodes} node(s) × {gpus} GPU(s)", gpus * nodes, link, memory_gb * GB, "cuda", 1, nodes,
                   inter, True, compute_scale, flops)


#: From public specs (bandwidth per direction and GPU; α is NCCL's typical small-message latency, not a spec): H100
#: SXM 80 GB HBM3, 989 TFLOP/s dense bf16, NVLink 4 at 450 GB/s each way (900 both); A100 PCIe 80 GB, 312 TFLOP/s,
#: PCIe Gen4 x16 at 32 GB/s each way (about 25 reached); between nodes a 400 Gb/s InfiniBand NIC per GPU (50 GB/s).
NVLINK4 = CostModel(5e-6, 1 / 450e9)
NAMED = {
    "h100-nvlink": dict(gpus=8, memory_gb=80, link=NVLINK4, flops=989e12, name="one H100 node with NVLink"),
    "a100-pcie": dict(gpus=8, memory_gb=80, link=CostModel(10e-6, 1 / 25e9), flops=312e12, name="one A100 PCIe node"),
    "h100-2x-ib": dict(gpus=8, nodes=2, memory_gb=80, link=NVLINK4, inter=CostModel(10e-6, 1 / 50e9), flops=989e12,
                       name="two H100 nodes over InfiniBand"),
}


def named(name: str, **changes) -> Topology:
    """A topology of :data:`NAMED` (e.g. ``named("h100-nvlink")``), with ``changes`` to its arguments."""
    if name not in NAMED:
        raise ConfigError(f"unknown topology {name!r}; choose one of: {', '.join(NAMED)}")
    return Topology.gpu_node(**{**NAMED[name], **changes})


def ring_counts(kind: str, p: int) -> tuple[float, float]:
    """``(messages, share)`` one rank sends in a ring collective of ``kind`` over ``p`` ranks, per byte of the
    buffer: ``p2p (1, 1)``; ``all_reduce (2(p − 1), 2(p − 1)/p)``; ``reduce_scatter`` and ``all_gather``
    ``(p − 1, (p − 1)/p)``; ``broadcast`` (flat, the root sending to each) ``(p − 1, p − 1)``."""
    return {"p2p": (1, 1), "all_reduce": (2 * (p - 1), 2 * (p - 1) / p), "broadcast": (p - 1, p - 1)}.get(
        kind, (p - 1, (p - 1) / p))


def collective_time(kind: str, nbytes: float, ranks: int, topo, count: int = 1) -> float:
    """``k·C_kind(n, p) = k·(m·α + s·n·β)``: ``k = count`` collectives of an ``n``-byte buffer over ``p`` ranks,
    ``(m, s)`` = :func:`ring_counts`, the kind's α and β; 0 on one rank."""
    if ranks <= 1:
        return 0.0
    link, (messages, share) = topo.link_of(kind, ranks), ring_counts(kind, ranks)
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
    """``Σ_buckets AR(bucket, algo, p)``: buckets of at most 25 MB (DDP's ``bucket_cap_mb`` default, labkit's
    ``--bucket-mb``), PyTorch's DDP's first one (the last layers' gradients) of 1 MB."""
    first = min(nbytes, MB) if algorithm == "ddp" else 0.0
    full, rest = divmod(nbytes - first, 25 * MB)
    return (allreduce_time(first, ranks, algorithm, topo) + full * allreduce_time(25 * MB, ranks, algorithm, topo)
            + allreduce_time(rest, ranks, algorithm, topo))


def broadcast_time(count: int, nbytes: float, ranks: int, topo) -> float:
    """``BC(k, n) = k·C_broadcast(n/k, p) = (p − 1)·(k·α + β·n)``: ``k`` broadcasts of ``n`` bytes in all."""
    return collective_time("broadcast", nbytes / count, ranks, topo, count) if count else 0.0


def compute_scale(topo, processes: int, prof=None) -> float:
    """``s = over(q) · device · κ_q``: how much slower each of ``q`` processes computes than the profile's one
    alone: oversubscription (``q / c`` past the cores), device speed, and on a CPU ``κ_q = 1 + (κ − 1)·(min(q, n)
    − 1)/(n − 1)`` with κ the measured slowdown of ``n = c // threads`` processes computing at once."""
    cpu = topo.device == "cpu"
    n = topo.cores // prof.threads if prof is not None and cpu else 1
    kappa = 1 + (prof.concurrency - 1) * (min(processes, n) - 1) / (n - 1) if n > 1 else 1.0
    return (max(1.0, processes / topo.cores) if cpu else 1.0) * topo.compute_scale * kappa


def common_terms(prof, topo, params: float, loaded: float) -> dict[str, float]:
    """``update = u·P_dev·device speed``, ``data = d·samples loaded``."""
    return {"update": prof.update_s_per_byte * params * topo.compute_scale, "data": prof.data_s_per_sample * loaded}


def memory_terms(prof, topo, params: float, activations: float, buffers: float = 0.0) -> dict[str, float]:
    """``3·P_dev`` (parameters, gradients, momentum) ``+ activations + buffers (+ runtime on a CPU)``."""
    return {"parameters": params, "gradients": params, "optimizer": params, "activations": activations,
            "buffers": buffers, "runtime": prof.base_bytes if topo.device == "cpu" else 0.0}


def stages_of(balance) -> list[range]:
    """Layer index ranges of the stages: ``[3, 2] -> [range(0, 3), range(3, 5)]``."""
    return [range(end - n, end) for n, end in zip(balance, itertools.accumulate(balance))]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a fill-and-drain (GPipe) step of equal stages, simulated from its schedule
    (:mod:`labkit.parallel.pp_simulate`): ``(p − 1) / (m + p − 1)``."""
    from labkit.parallel.pp_schedule import pipe_schedule
    from labkit.parallel.pp_simulate import simulate

    return float(simulate(pipe_schedule("gpipe", stages, microbatches)).bubble)


def pipeline_terms(stage_times: list[float], stage_comm: list[float], microbatches: int,
                   critical_path: bool = False, schedule: str = "gpipe", chunks: int = 1) -> dict[str, float]:
    """A step over ``p`` stages of slots ``τ_j = t_j + c_j`` (compute, messages out, per micro-batch), the slowest
    ``τ = τ_{j*}`` pacing it: ``compute = m·t_{j*}``, ``communication = m·c_{j*}``, and ``bubble`` the rest of the
    step that :func:`labkit.parallel.pp_simulate.simulate` gives for ``schedule``'s action lists, each stage's
    forward a third of its slot and its backward two thirds (with ``critical_path`` every stage at its own slot, else
    all at the pace ``τ``). For GPipe that is ``Σ_{j≠j*} τ_j`` (the first micro-batch crosses each other stage at its
    own pace) or ``(p − 1)·τ``: the formulas, counted rather than written a second time. ``chunks``: stages per
    rank (``len(stage_times)`` is then ``p·chunks``)."""
    from labkit.parallel.pp_schedule import pipe_schedule
    from labkit.parallel.pp_simulate import step_time

    slots = [t + c for t, c in zip(stage_times, stage_comm)]
    j = slots.index(max(slots))
    paced = slots if critical_path else [slots[j]] * len(slots)
    thirds = [float(x) / 3 for x in paced]
    step = step_time(pipe_schedule(schedule, len(slots) // chunks, microbatches, chunks), thirds, thirds, thirds)
    bubble = max(0.0, float(step) - microbatches * slots[j])
    return {"compute": microbatches * stage_times[j], "communication": microbatches * stage_comm[j], "bubble": bubble}

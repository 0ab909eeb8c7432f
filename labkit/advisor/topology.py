"""The device topology (seed 000's ``D = (D_N, D_E)``): devices, their memory, and an α-β-γ price per link, the
same for every strategy: a message of ``n`` bytes costs ``α + β·n``, reducing ``n`` bytes ``γ·n``
(:class:`labkit.collectives.cost.CostModel`). :meth:`Topology.local`: gloo ranks on this machine; :data:`NAMED`:
GPU nodes from the vendors' public specifications.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from labkit.collectives.cost import CostModel
from labkit.errors import ConfigError

GB, MB = 2**30, 2**20


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

    @property
    def per_node(self) -> int:
        return -(-self.ranks // self.nodes)

    def threads(self, processes: int) -> int:
        """CPU threads per process when ``processes`` share the cores (at least one)."""
        return max(1, self.cores // processes) if self.device == "cpu" else 1

    def oversubscription(self, processes: int) -> float:
        """How much slower each process computes because processes outnumber cores (1 if they fit)."""
        return max(1.0, processes / self.cores) if self.device == "cpu" else 1.0

    def link_of(self, kind: str, ranks: int) -> CostModel:
        """The α-β a collective of ``kind`` over ``ranks`` consecutive ranks pays: between nodes the slower
        ``inter``; inside a node the kind's measured prices, or ``link``."""
        if self.inter is not None and ranks > self.per_node:
            return self.inter
        return self.kinds.get(kind, self.link)

    def with_memory(self, gigabytes: float | None) -> Topology:
        return self if gigabytes is None else replace(self, memory_bytes=gigabytes * GB)

    @classmethod
    def local(cls, ranks: int, link: CostModel | None = None, cache: str | Path = Path("runs") / "advisor",
              refresh: bool = False, fit: dict | None = None) -> Topology:
        """``ranks`` gloo ranks on this machine, a plan of ``q`` processes giving each ``cores // q`` threads. The
        link: ``link`` (for every kind); else one per kind of collective, cached or measured now by
        :func:`labkit.advisor.measure.measure_link` (``refresh``, and ``fit``: its ``windows`` and ``calls``)."""
        from labkit.advisor.measure import measure_link

        if ranks < 1:
            raise ConfigError(f"--ranks must be >= 1, got {ranks}")
        found = (link, {}) if link is not None else measure_link(ranks, Path(cache) / f"links-{ranks}", refresh,
                                                                 **(fit or {}))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(f"{ranks} gloo rank(s) on this host", ranks, found[0], memory / ranks, "cpu",
                   os.cpu_count() or 1, kinds=found[1])

    @classmethod
    def gpu_node(cls, gpus: int, memory_gb: float = 80.0, link: CostModel | None = None, compute_scale: float = 0.05,
                 nodes: int = 1, inter: CostModel | None = None, flops: float = 0.0,
                 name: str | None = None) -> Topology:
        """``gpus`` GPUs per node on ``nodes`` nodes. Default link: NVLink-class, α 10 µs, 150 GB/s; between
        nodes (default) α 20 µs, 12.5 GB/s (100 Gb/s InfiniBand). ``compute_scale`` maps CPU-profiled times to
        the GPU's (a rough guess: profile on the GPU node itself for real numbers)."""
        link = link or CostModel(alpha=10e-6, beta=1 / 150e9)
        inter = (inter or CostModel(alpha=20e-6, beta=1 / 12.5e9)) if nodes > 1 else inter
        return cls(name or f"{nodes} node(s) × {gpus} GPU(s)", gpus * nodes, link, memory_gb * GB, "cuda", 1, nodes,
                   inter, True, compute_scale, flops)


#: From public specs (bandwidth per direction and GPU; α is NCCL's typical small-message latency, not a spec):
#: H100 SXM: 80 GB HBM3, 989 TFLOP/s dense bf16, NVLink 4 at 900 GB/s per GPU both ways (450 each way);
#: A100 PCIe 80 GB: 312 TFLOP/s dense bf16, PCIe Gen4 x16 at 32 GB/s each way (about 25 GB/s reached);
#: between nodes one 400 Gb/s NDR InfiniBand adapter per GPU (50 GB/s each way).
H100_FLOPS, A100_FLOPS = 989e12, 312e12
NVLINK4 = CostModel(5e-6, 1 / 450e9)
NAMED = {
    "h100-nvlink": dict(gpus=8, memory_gb=80, link=NVLINK4, flops=H100_FLOPS, name="one H100 node with NVLink"),
    "a100-pcie": dict(gpus=8, memory_gb=80, link=CostModel(10e-6, 1 / 25e9), flops=A100_FLOPS,
                      name="one A100 PCIe node"),
    "h100-2x-ib": dict(gpus=8, nodes=2, memory_gb=80, link=NVLINK4, inter=CostModel(10e-6, 1 / 50e9),
                       flops=H100_FLOPS, name="two H100 nodes over InfiniBand"),
}


def named(name: str, **changes) -> Topology:
    """A topology of :data:`NAMED` (e.g. ``named("h100-nvlink")``), with ``changes`` to its arguments."""
    if name not in NAMED:
        raise ConfigError(f"unknown topology {name!r}; choose one of: {', '.join(NAMED)}")
    return Topology.gpu_node(**{**NAMED[name], **changes})

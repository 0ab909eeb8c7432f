"""The device topology: devices, their memory, and an α-β(-γ) price per link (seed 000's ``D = (D_N, D_E)``).

A message of ``n`` bytes over a link costs ``alpha + beta · n``; reducing ``n`` bytes costs ``gamma · n``
(:class:`labkit.collectives.cost.CostModel`). A collective launched *between computations*, as a training step
launches them, also costs ``launch`` (κ) seconds: the rank that arrives first sleeps in its wait and must be
woken and scheduled again when its peer's data comes, which on a busy CPU means queueing behind other
processes. The α-β fit, whose ranks exchange messages of at most 1 MB in a tight loop, does not see it; nor that
a byte of a large collective sent from a step, after a forward and backward filled the caches, costs
``step_bytes`` times what the fit prices it (:func:`labkit.advisor.calibrate.bytes_in_step`): a plan's
collectives are priced with β and γ times that. Three shapes:

* :meth:`Topology.local` — N gloo ranks on this machine: the link is fitted by the collectives benchmark
  (``labkit allreduce bench --out DIR`` writes ``"cost-model"`` records) or measured on the spot with the
  same fit, cached in the same record format. Every rank is a process on the same cores, so a plan with
  ``q`` processes gives each ``cores // q`` threads, and one process's "devices" are the same CPU.
* :meth:`Topology.gpu_node` — G GPUs in one node (NCCL over NVLink/PCIe): one process may drive several
  GPUs that really run at once.
* ``nodes > 1`` — two levels: ``link`` inside a node, ``inter`` between nodes. A ring over all ranks
  crosses the slower level, so collectives spanning nodes are priced with ``inter``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from labkit.collectives.cost import CostModel
from labkit.errors import ConfigError

GB = 2**30


@dataclass(frozen=True)
class Topology:
    """Devices and links one job may use.

    Attributes:
        ranks: processes (and devices) the job may start.
        link: α-β-γ inside a node; ``inter``: between nodes (None on one node).
        memory_bytes: usable memory per device (on CPU: the host's memory shared by the ranks).
        cores: CPU cores the ranks share (CPU topologies); a process gets ``cores // processes`` threads.
        separate_devices: the devices one process drives really run at once (GPUs); False on one CPU.
        compute_scale: device speed relative to the profile (0.1: ten times faster than profiled).
        launch_s: κ, seconds every collective or message launched between computations costs on top of its
            α-β price (0 on GPUs, where the host does not wait for it).
        step_bytes: ``f``, what a byte of a collective in a training step costs over the fit's price of it (1 on
            GPUs and hand-made topologies); :meth:`collective_link` applies it.
        call_s: measured seconds per collective in a training step (keys :data:`CALL_KEYS`:
            ZeRO stages and ZeRO's buffer broadcasts, FSDP, DDP, tensor parallelism, and the pipeline
            schedule's price per micro-batch and stage;
            :mod:`labkit.advisor.calibrate`); where absent, α-β and κ price each one.
    """

    name: str
    ranks: int
    link: CostModel
    memory_bytes: float
    device: str = "cpu"
    cores: int = 1
    nodes: int = 1
    inter: CostModel | None = None
    separate_devices: bool = False
    compute_scale: float = 1.0
    launch_s: float = 0.0
    call_s: dict = field(default_factory=dict)
    step_bytes: float = 1.0

    def __post_init__(self):
        if self.ranks < 1:
            raise ConfigError(f"--ranks must be >= 1, got {self.ranks}")

    def threads(self, processes: int) -> int:
        """CPU threads per process when ``processes`` share the cores (at least one)."""
        return max(1, self.cores // processes) if self.device == "cpu" else 1

    def oversubscription(self, processes: int) -> float:
        """How much slower each process computes because processes outnumber cores (1 if they fit)."""
        return max(1.0, processes / self.cores) if self.device == "cpu" else 1.0

    def collective_link(self, ranks: int) -> CostModel:
        """The link a collective of a training step over the first ``ranks`` ranks is limited by (the slowest
        level it crosses), its β and γ times :attr:`step_bytes`."""
        per_node = -(-self.ranks // self.nodes)
        link = self.inter if self.inter is not None and ranks > per_node else self.link
        return in_step(link, self.step_bytes)

    def with_memory(self, gigabytes: float | None) -> Topology:
        return self if gigabytes is None else replace(self, memory_bytes=gigabytes * GB)

    @classmethod
    def local(cls, ranks: int, link: CostModel | None = None, links_from: str | Path | None = None,
              cache: str | Path = Path("runs") / "advisor", refresh: bool = False, rounds: int = 1) -> Topology:
        """``ranks`` gloo ranks on this machine; the link from ``link``, a bench run dir, a cache, or measured now
        (``refresh``: measured now even if cached; ``rounds``: the median of that many fits)."""
        if ranks < 1:
            raise ConfigError(f"--ranks must be >= 1, got {ranks}")
        launch, call, factor = 0.0, {}, 1.0
        if link is None and links_from:
            link, launch, call, factor = read_fit(links_from, ranks)
            # `labkit allreduce bench` measures neither κ, nor the per-collective prices, nor f
            launch, factor = launch or 0.0, factor or 1.0
        elif link is None and not refresh:
            link, launch, call, factor = read_fit(Path(cache) / f"links-{ranks}", ranks, False)
            # a cache from before κ, f, or one of the prices was calibrated, is measured again
            if launch is None or factor is None or call is None or not CALL_KEYS <= set(call):
                link = None
        if link is None:
            link, launch, call, factor = measure_link(ranks, Path(cache) / f"links-{ranks}", rounds)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(f"{ranks} gloo rank(s) on this host", ranks, link, memory / ranks, "cpu", os.cpu_count() or 1,
                   launch_s=launch, call_s=call or {}, step_bytes=factor)

    @classmethod
    def gpu_node(cls, gpus: int, memory_gb: float = 80.0, link: CostModel | None = None, compute_scale: float = 0.05,
                 nodes: int = 1, inter: CostModel | None = None) -> Topology:
        """``gpus`` GPUs per node on ``nodes`` nodes. Default link: NVLink-class, α 10 µs, 150 GB/s; between
        nodes (default) α 20 µs, 12.5 GB/s (100 Gb/s InfiniBand). ``compute_scale`` maps CPU-profiled times to
        the GPU's (a rough guess: profile on the GPU node itself for real numbers)."""
        link = link or CostModel(alpha=10e-6, beta=1 / 150e9)
        if nodes > 1:
            inter = inter or CostModel(alpha=20e-6, beta=1 / 12.5e9)
        return cls(f"{nodes} node(s) × {gpus} GPU(s)", gpus * nodes, link, memory_gb * GB, "cuda", 1, nodes, inter,
                   True, compute_scale)


def in_step(link: CostModel, factor: float) -> CostModel:
    """``link`` with β and γ times ``factor``: what its bytes cost when a training step sends them."""
    return link if factor == 1.0 else CostModel(link.alpha, link.beta * factor, link.gamma * factor)


def read_fit(path: str | Path, ranks: int, required: bool = True
             ) -> tuple[CostModel | None, float | None, dict[str, float] | None, float | None]:
    """``(α-β-γ fit, κ, per-collective prices, f)`` for ``ranks`` ranks from a run with ``"cost-model"`` records;
    κ, the prices and f (``step_bytes``) are None where the run did not measure them."""
    from labkit.results import load_run

    try:
        run = load_run(path)
    except (FileNotFoundError, ValueError) as exc:
        if required:
            raise ConfigError(f"--links {path}: {exc}; write one with `labkit allreduce bench --out {path}`") from None
        return None, None, None, None
    fits = {r["world_size"]: r for r in run.records_of("cost-model")}
    if ranks not in fits:
        if ranks == 1:
            return CostModel(0.0, 0.0, 0.0), 0.0, {}, 1.0
        if required:
            raise ConfigError(f"--links {path} has fits for {sorted(fits)} rank(s), not {ranks}; "
                              f"run `labkit allreduce bench --ranks {ranks} --out {path}`")
        return None, None, None, None
    fit = fits[ranks]
    return (CostModel(fit["alpha"], fit["beta"], fit.get("gamma", 0.0)), fit.get("launch"), fit.get("call"),
            fit.get("step_bytes"))


#: the per-collective prices :mod:`labkit.advisor.calibrate` measures (a cache missing one is measured again)
CALL_KEYS = {"zero-1", "zero-2", "zero-3", "zero-broadcast", "fsdp", "fsdp-no-reshard", "ddp", "ddp-kit",
             "tensor-parallel", "pipeline-m2", "pipeline-m4", "pipeline-m8"}

#: message sizes of the on-the-spot fit: from latency-bound to bandwidth-bound, small enough to take seconds
FIT_SIZES = [4, 16 << 10, 256 << 10, 1 << 20]


def _per_call(fn, calls: int = 20, windows: int = 5, quantile: float = 0.5, each: bool = False):
    """Seconds per call of ``fn`` back to back, the ``quantile`` of ``windows`` (default the median), the slowest
    rank's (``each``: every rank's, a list in rank order)."""
    import time

    import torch
    import torch.distributed as dist

    from labkit import dist as kdist

    times = []
    for _ in range(windows):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    times.sort()
    mine = torch.tensor(times[round(quantile * (len(times) - 1))], dtype=torch.float64)
    if each:
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        kdist.all_gather(gathered, mine)
        return [t.item() for t in gathered]
    kdist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def _fit_rank(env):
    """Everything the topology measures, on every rank:

    * α-β-γ from the point-to-point fit, the lower quartile of 9 rounds per size (on a virtual machine the
      latency has slow spells lasting seconds — α 0.15 ms, then 1.0–1.6 ms — and a median flips between them;
      what a step pays beyond the quiet α is κ's and the calibration's part);
    * κ = (a small computation + a 4-byte all-reduce) − the computation alone − the all-reduce alone, back to
      back (the tight loop the α-β fit sees);
    * f (``step_bytes``): a byte's price in a step over the fit's price of it
      (:func:`labkit.advisor.calibrate.bytes_in_step`);
    * the price per collective in a step of ZeRO, FSDP, DDP and tensor parallelism, and per micro-batch and stage
      of the pipeline schedule (:mod:`labkit.advisor.calibrate`).
    """
    import torch

    from labkit import dist as kdist
    from labkit.advisor.calibrate import bytes_in_step, calibrate_rank
    from labkit.collectives.cost import fit_cost_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))  # as the plans' ranks run
    model, points = fit_cost_model(FIT_SIZES, repeats=9, quantile=0.25)
    a, tiny = torch.randn(96, 96), torch.zeros(1)

    def work():
        for _ in range(4):
            a @ a

    def both():
        work()
        kdist.all_reduce(tiny)

    work_s, alone_s = _per_call(work), _per_call(lambda: kdist.all_reduce(tiny))
    launch = max(0.0, _per_call(both) - work_s - alone_s)
    factor = bytes_in_step(_per_call, model, env.world_size)
    return {"alpha": model.alpha, "beta": model.beta, "gamma": model.gamma, "launch": launch, "step_bytes": factor,
            "p2p": points, "call": calibrate_rank(env, in_step(model, factor), _per_call)}  # bytes at a step's price


def median_fit(fits: list[dict]) -> dict:
    """One fit from several rounds: the median of each number (α, β, γ, κ and every calibrated price); the
    first round's measured points. A round caught in one of the machine's slow spells moves no median. What a
    round measures in a step is a byte's price, ``f·β`` (f is that over its own β): its median over the median β
    gives f (at least 1)."""
    import statistics

    out = {key: statistics.median(f[key] for f in fits) for key in ("alpha", "beta", "gamma", "launch")}
    byte_price = statistics.median(f["step_bytes"] * f["beta"] for f in fits)
    out["step_bytes"] = max(1.0, byte_price / out["beta"]) if out["beta"] > 0 else 1.0
    out["call"] = {key: statistics.median(f["call"][key] for f in fits) for key in fits[0]["call"]}
    return {**out, "p2p": fits[0]["p2p"], "rounds": len(fits)}


def measure_link(ranks: int, out: Path, rounds: int = 1) -> tuple[CostModel, float, dict[str, float], float]:
    """Fit α-β-γ, κ and f and calibrate the sharded strategies on ``ranks`` spawned gloo ranks now (``rounds``
    times, each number the median: :func:`median_fit`); cache them at ``out`` (the bench's record format)."""
    if ranks == 1:
        return CostModel(0.0, 0.0, 0.0), 0.0, {}, 1.0
    from labkit.results import RunWriter
    from labkit.testing import run_ranks

    fit = median_fit([run_ranks(_fit_rank, ranks, timeout=300)[0] for _ in range(max(1, rounds))])
    writer = RunWriter(out)
    writer.log({"kind": "cost-model", "world_size": ranks, **fit})
    writer.finish(f"links {ranks}", "cost-model", {"ranks": ranks}, {"alpha": fit["alpha"], "beta": fit["beta"],
                                                                     "launch": fit["launch"], "call": fit["call"],
                                                                     "step_bytes": fit["step_bytes"]})
    return CostModel(fit["alpha"], fit["beta"], fit["gamma"]), fit["launch"], fit["call"], fit["step_bytes"]

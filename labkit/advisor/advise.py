"""``advise``: profile, build the topology, search, and keep the result as a table and ``advice.json``.

    from labkit.advisor import advise
    advice = advise("alexnet_small", "synthetic-cifar10", ranks=2, batch_size=64)
    advice.best.plan.command("alexnet_small", "synthetic-cifar10")
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from labkit.advisor.plan import Estimate
from labkit.advisor.profile import CACHE, Profile, load_or_measure
from labkit.advisor.search import best_per_strategy, candidates, check_fits
from labkit.advisor.topology import Topology
from labkit.errors import ConfigError

ADVICE_SCHEMA = "labkit.advice/1"


@dataclass
class Advice:
    """Ranked estimates (``estimates``: every plan; ``table``: the best plan of each strategy)."""

    model: str
    dataset: str
    batch_size: int
    topology: Topology
    estimates: list[Estimate]
    table: list[Estimate]
    profiles: dict[int, Profile] = field(default_factory=dict)
    measured: dict[str, dict] = field(default_factory=dict)   # plan label -> measured values
    train_args: tuple[str, ...] = ()                            # more `labkit train` flags for every command

    def command(self, est: Estimate) -> str:
        return est.plan.command(self.model, self.dataset, self.train_args)

    @property
    def best(self) -> Estimate:
        return self.table[0]

    def find(self, label: str) -> Estimate:
        for est in self.estimates:
            if est.plan.label == label:
                return est
        raise ConfigError(f"no plan {label!r}; plans: {', '.join(e.plan.label for e in self.table)}")

    def to_dict(self) -> dict:
        t = self.topology
        return {"schema": ADVICE_SCHEMA, "model": self.model, "dataset": self.dataset, "batch_size": self.batch_size,
                "topology": {"name": t.name, "ranks": t.ranks, "device": t.device, "cores": t.cores,
                             "alpha": t.link.alpha, "beta": t.link.beta, "gamma": t.link.gamma,
                             "memory_bytes": t.memory_bytes},
                "plans": [{**e.to_dict(), "command": self.command(e),
                           "measured": self.measured.get(e.plan.label)} for e in self.table]}

    def write(self, path: str | Path) -> Path:
        from labkit.results import atomic_write_text

        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def advise(model: str, dataset: str = "mnist-sample", ranks: int = 2, batch_size: int = 64,
           memory_limit_gb: float | None = None, topology: Topology | None = None, links: str | None = None,
           cache: str | Path = CACHE, refresh: bool = False, profile_topology: Topology | None = None) -> Advice:
    """Rank every plan for ``model`` on ``dataset`` over ``ranks`` devices (this machine unless ``topology``).

    Args:
        batch_size: the global batch (samples per optimizer step); data-parallel plans split it.
        memory_limit_gb: usable memory per device; plans above it are marked infeasible, and if none
            fits a :class:`ConfigError` names the smallest memory that would.
        links: a results run with ``"cost-model"`` records (``labkit allreduce bench --out DIR``).
        profile_topology: whose thread counts the profiles are measured at (default ``topology``): price a
            GPU topology with this machine's profile.
    """
    from labkit import data as kdata
    from labkit import models as kmodels

    if model not in kmodels.MODELS:
        raise ConfigError(f"unknown model {model!r}; choose one of: {', '.join(kmodels.MODELS)}")
    kdata.dataset_info(dataset)
    if ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if memory_limit_gb is not None and memory_limit_gb <= 0:
        raise ConfigError(f"--memory-limit must be > 0 GB, got {memory_limit_gb}")
    topo = topology or Topology.local(ranks, links_from=links, cache=cache, refresh=refresh)
    topo = topo.with_memory(memory_limit_gb)
    measure_on = profile_topology or topo

    @lru_cache(maxsize=None)
    def prof_for(processes: int) -> Profile:
        return load_or_measure(model, dataset, batch_size, measure_on.threads(processes), cache, refresh)

    estimates = candidates(prof_for, topo, batch_size)
    if memory_limit_gb is not None:
        check_fits(estimates, memory_limit_gb)
    table = [e for e in best_per_strategy(estimates) if e.applicable]
    profiles = {measure_on.threads(p): prof_for(p) for p in {1, ranks}}
    return Advice(model, dataset, batch_size, topo, estimates, table, profiles)

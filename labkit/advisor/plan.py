"""The advisor's plain data (no torch): :class:`Plan`, its :class:`Estimate`, :class:`Profile`, :class:`MeshPlan`."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.advisor.topology import Topology
from labkit.errors import ConfigError
from labkit.results import atomic_write_text


@dataclass(frozen=True)
class Plan:
    """``labkit train --strategy {strategy}`` on ``processes`` ranks using ``devices`` devices."""

    strategy: str
    processes: int
    devices: int
    batch_size: int                    # samples per optimizer step over the whole job (the global batch)
    options: tuple = ()                # the strategy's own flags: ((dest, value), ...), e.g. (("balance", (5, 7)),)
    data_parallel: int = 1             # ranks training their own share of the batch (the search reads the
                                       # strategy's ADVISOR literal for it: "split" = every rank, "workers")

    @property
    def option(self) -> dict:
        return dict(self.options)

    @property
    def per_rank_batch(self) -> int:  # --batch-size
        return self.batch_size // self.data_parallel

    @property
    def label(self) -> str:
        """A short name, e.g. ``pipeline×2 m=4 [5,7]`` or ``ddp×2 ring``."""
        o = self.option
        words = [o.get("allreduce"), "zero_stage" in o and f"stage {o['zero_stage']}",
                 "ps_servers" in o and f"S={o['ps_servers']}", o.get("fsdp_no_reshard") and "no-reshard",
                 o.get("schedule"), "num_microbatches" in o and f"m={o['num_microbatches']}",
                 o.get("mp_split_size") and f"split={o['mp_split_size']}",
                 *("[" + ",".join(map(str, o[key])) + "]" for key in ("balance", "mp_split_points") if key in o)]
        head = f"{self.strategy}×{self.devices}" if self.devices > 1 else self.strategy
        return " ".join([head, *filter(None, words)])

    def train_args(self, model: str, dataset: str) -> list[str]:
        args = ["train", "--model", model, "--dataset", dataset, "--strategy", self.strategy,
                "--batch-size", str(self.per_rank_batch)]
        for dest, value in self.options:  # True: a switch; None, False: left out; a tuple or list: its values
            values = [] if value is True else value if isinstance(value, (tuple, list)) else [value]
            if value is not None and value is not False:
                args += ["--" + dest.replace("_", "-"), *map(str, values)]
        return args

    def command(self, model: str, dataset: str, extra: list[str] | tuple = ()) -> str:
        launch = "labkit" if self.processes == 1 else f"torchrun --nproc_per_node {self.processes} -m labkit"
        return " ".join([launch, *self.train_args(model, dataset), *extra])

    def to_dict(self) -> dict:
        return {**asdict(self), "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.options}}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        opts = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in d.get("options", {}).items())
        return cls(d["strategy"], int(d["processes"]), int(d["devices"]), int(d["batch_size"]), opts,
                   int(d.get("data_parallel", 1)))


@dataclass
class Estimate:
    """A plan's predicted step: named cost terms in seconds and bytes."""

    plan: Plan
    time: dict[str, float] = field(default_factory=dict)    # seconds per optimizer step
    memory: dict[str, float] = field(default_factory=dict)  # bytes on the plan's fullest device
    limit_bytes: float = float("inf")                       # usable memory per device
    note: str = ""                                          # why the plan cannot run ("": it can)
    threads: int = 0  # CPU threads per process of the profile that priced it, for a validation run (0: not a CPU's)

    @property
    def step_s(self) -> float:
        return sum(self.time.values())

    @property
    def samples_per_s(self) -> float:
        return self.plan.batch_size / self.step_s if self.step_s > 0 else float("inf")

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def applicable(self) -> bool:
        return not self.note

    @property
    def feasible(self) -> bool:  # runs at all and fits in every device's memory
        return self.applicable and self.peak_bytes <= self.limit_bytes

    @property
    def main_term(self) -> str:
        """The largest time term but compute if it is at least a fifth of the step, else compute."""
        if not self.time:
            return "-"
        other = max((k for k in self.time if k != "compute"), key=self.time.get, default="compute")
        return other if self.time[other] >= 0.2 * self.step_s else "compute"

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "label": self.plan.label, "step_s": self.step_s,
                "samples_per_s": self.samples_per_s, "peak_bytes": self.peak_bytes, "feasible": self.feasible,
                "note": self.note, "main_term": self.main_term, "time": dict(self.time), "memory": dict(self.memory)}


@dataclass
class LayerProfile:
    """One layer: ``fwd = (fwd0 s, fwd1 s/sample)``, ``bwd`` alike; bytes are per sample where so named."""

    name: str
    kind: str
    fwd: tuple[float, float]
    bwd: tuple[float, float]
    param_bytes: int
    out_bytes: int
    saved_bytes: int
    units: int = 1                        # modules owning parameters directly (ZeRO/FSDP shard each one)
    buffers: int = 0                      # buffer tensors (batch-norm statistics), broadcast every ZeRO step
    buffer_bytes: int = 0

    def time(self, batch: float) -> float:
        """Forward + backward seconds on ``batch`` samples: ``fwd0 + bwd0 + (fwd1 + bwd1) · b``."""
        return self.fwd[0] + self.bwd[0] + (self.fwd[1] + self.bwd[1]) * batch


@dataclass
class Profile:
    """What the cost model needs of one model on one machine at one thread count (:mod:`~labkit.advisor.measure`)."""

    model: str
    dataset: str
    threads: int
    sizes: tuple[int, int]
    layers: list[LayerProfile]
    input_bytes: int                      # one sample
    update_s_per_byte: float
    data_s_per_sample: float
    base_bytes: int                       # a process's memory before the model (runtime, libraries)
    feature_layers: int | None = None     # first layers that form ``model.features`` (hybrid)
    tp_pairs: list[tuple[int, int]] = field(default_factory=list)  # (column, row) Linear indices
    tp_hidden: list[int] = field(default_factory=list)             # out_features of each column layer
    concurrency: float = 1.0              # κ: each of cores // threads processes' step at once ÷ one alone

    @property
    def buffers(self) -> tuple[int, int]:  # (N_buf, bytes): buffer tensors (batch-norm statistics)
        return sum(layer.buffers for layer in self.layers), sum(layer.buffer_bytes for layer in self.layers)

    def select(self, layers: range | None = None) -> list[LayerProfile]:  # layers S of the sums below (default all)
        return self.layers if layers is None else [self.layers[i] for i in layers]

    def time(self, batch: float, layers: range | None = None) -> float:  # T_S(b)
        return sum(layer.time(batch) for layer in self.select(layers))

    def saved_bytes(self, batch: float, layers: range | None = None) -> float:  # M_S(b)
        return batch * sum(layer.saved_bytes for layer in self.select(layers))

    def params(self, layers: range | None = None) -> int:  # P_S
        return sum(layer.param_bytes for layer in self.select(layers))

    param_bytes = property(params)  # P: every layer's


def profile_from_dict(d: dict) -> Profile:
    """A :class:`Profile` read back from JSON (``dataclasses.asdict``'s inverse)."""
    layers = [LayerProfile(**{**x, "fwd": tuple(x["fwd"]), "bwd": tuple(x["bwd"])}) for x in d["layers"]]
    return Profile(**{**d, "layers": layers, "sizes": tuple(d["sizes"]), "tp_pairs": list(map(tuple, d["tp_pairs"]))})


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
    schedule: str = "1f1b"   # the pipeline's (labkit.parallel.pp_schedule names) and its chunks per rank
    virtual: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def label(self) -> str:
        dims = ",".join(f"{k}={getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1)
        extra = [self.pp > 1 and f"m={self.microbatches}",
                 self.pp > 1 and self.schedule != "1f1b" and f"{self.schedule}" + (f" v={self.virtual}" if
                                                                                  self.virtual > 1 else ""),
                 self.zero and f"zero{self.zero}",
                 self.sequence_parallel and "sp", self.recompute and "recompute"]
        return " ".join([dims or "one device", *filter(None, extra)])


@dataclass
class Advice:
    """Ranked estimates (``estimates``: every plan; ``table``: the best plan of each strategy)."""

    model: str
    dataset: str
    batch_size: int
    topology: Topology
    estimates: list[Estimate]
    table: list[Estimate]
    profiles: dict[int, Profile] = field(default_factory=dict)  # processes -> the profile their plans are priced by
    measured: dict[str, dict] = field(default_factory=dict)   # plan label -> measured values
    train_args: tuple[str, ...] = ()                            # more `labkit train` flags for every command

    def command(self, est: Estimate) -> str:
        return est.plan.command(self.model, self.dataset, self.train_args)

    @property
    def best(self) -> Estimate:
        return self.table[0]

    def find(self, label: str) -> Estimate:
        if est := next((e for e in self.estimates if e.plan.label == label), None):
            return est
        raise ConfigError(f"no plan {label!r}; plans: {', '.join(e.plan.label for e in self.table)}")

    def to_dict(self) -> dict:
        t = self.topology
        return {"schema": "labkit.advice/1", "model": self.model, "dataset": self.dataset,
                "batch_size": self.batch_size,
                "topology": {"name": t.name, "ranks": t.ranks, "device": t.device, "cores": t.cores, **asdict(t.link),
                             "memory_bytes": t.memory_bytes,
                             "kinds": {k: {"alpha": v.alpha, "beta": v.beta} for k, v in t.kinds.items()}},
                "plans": [{**e.to_dict(), "command": self.command(e),
                           "measured": self.measured.get(e.plan.label)} for e in self.table]}

    def write(self, path: str | Path) -> Path:
        atomic_write_text(path := Path(path), json.dumps(self.to_dict(), indent=2) + "\n")
        return path

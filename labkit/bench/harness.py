"""The one benchmark harness every ``labkit bench`` uses: contenders alternated round by round, medians and spread.

    results = alternate({"labkit": run_labkit, "plain": run_plain}, rounds=6, devices=[device])
    print(results.table("plain"))        # median samples/s, min-max over rounds, median paired ratio

A contender is a function that trains a fixed number of steps and returns the samples it processed (over the
whole job). The harness times every call the same way:

- warm-up: each contender runs ``warmup`` times untimed first (allocator growth, first-call costs, DDP's
  bucket rebuild on its second step);
- barriers: CUDA devices are synchronised and the ranks of a distributed job meet before the clock starts and
  after it stops; a distributed call lasts as long as its slowest rank (max over ranks);
- alternation: round r runs the contenders in the order rotated by r, so a slow drift of the machine (other
  jobs, frequency scaling) hits all of them alike;
- statistics: per contender the median samples/s over rounds and its min-max; between two contenders the
  median of the per-round ratios, each ratio taken from calls run back to back under the same load.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from labkit.dist import group as kdist


def sync(devices: Iterable[torch.device | str]) -> None:
    """Wait for the queued kernels of every CUDA device in ``devices`` (CPU work is already done)."""
    for device in dict.fromkeys(torch.device(d) for d in devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def time_call(fn: Callable[[], int], devices: Iterable[torch.device | str]) -> tuple[int, float, float]:
    """``(samples, wall seconds, CPU seconds of this process)`` of one call of ``fn`` between barriers."""
    devices = list(devices)
    sync(devices)
    if _distributed():
        dist.barrier()  # start together: a late rank would stall the others' collectives
    wall, cpu = time.perf_counter(), time.process_time()
    samples = fn()
    sync(devices)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if _distributed():
        slowest = torch.tensor([wall], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            slowest = slowest.to(devices[0])
        kdist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the job's step rate is set by its slowest rank
        wall = slowest.item()
    return samples, wall, cpu


@dataclass
class Results:
    """Per-round records ``{"kind": "bench", "contender", "round", "samples", "time_s", "cpu_s",
    "samples_per_sec"}`` of :func:`alternate`."""

    records: list[dict] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(r["contender"] for r in self.records))

    def rates(self, name: str) -> list[float]:
        """samples/s of ``name``, one per round."""
        return [r["samples_per_sec"] for r in self.records if r["contender"] == name]

    def median(self, name: str) -> float:
        return statistics.median(self.rates(name))

    def cpu_per_sample(self, name: str) -> float:
        """CPU seconds per sample over all rounds (steadier than wall time when other jobs share the CPUs)."""
        rows = [r for r in self.records if r["contender"] == name]
        return sum(r["cpu_s"] for r in rows) / sum(r["samples"] for r in rows)

    def ratios(self, name: str, reference: str) -> list[float]:
        """Per round: rate of ``name`` / rate of ``reference`` (pairs measured back to back)."""
        return [a / b for a, b in zip(self.rates(name), self.rates(reference))]

    def cpu_ratios(self, name: str, reference: str) -> list[float]:
        """Per round: CPU seconds per sample of ``name`` / those of ``reference`` (pairs measured back to back)."""
        def per_sample(who: str) -> list[float]:
            return [r["cpu_s"] / r["samples"] for r in self.records if r["contender"] == who]
        return [a / b for a, b in zip(per_sample(name), per_sample(reference))]

    def summary(self, reference: str | None = None) -> dict:
        """Metrics for ``summary.json``: per contender median samples/s and min/max; ratios to ``reference``."""
        metrics: dict = {}
        for name in self.names:
            rates = self.rates(name)
            metrics[name] = {"median_samples_per_sec": statistics.median(rates), "min_samples_per_sec": min(rates),
                             "max_samples_per_sec": max(rates), "rounds": len(rates)}
            if reference is not None and name != reference:
                ratios = self.ratios(name, reference)
                metrics[name].update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                                     cpu_time_ratio=self.cpu_per_sample(reference) / self.cpu_per_sample(name))
        return metrics

    def table(self, reference: str | None = None, target: float | None = None) -> str:
        """A plain-text table: median samples/s (min-max) and, against ``reference``, the median paired ratio."""
        lines = [f"{'contender':<22}{'samples/s':>12}{'min-max over rounds':>24}"
                 + (f"{'ratio':>9}{'(min-max)':>15}" if reference else "")]
        summary = self.summary(reference)
        for name in self.names:
            s = summary[name]
            line = (f"{name:<22}{s['median_samples_per_sec']:>12.1f}"
                    f"{s['min_samples_per_sec']:>12.1f} - {s['max_samples_per_sec']:<9.1f}")
            if "ratio" in s:
                line += f"{s['ratio']:>9.3f}  ({s['ratio_min']:.3f}-{s['ratio_max']:.3f})"
            lines.append(line)
        if reference:
            goal = f"; target >= {target}" if target is not None else ""
            lines.append(f"ratio = median over rounds of (contender / {reference}), measured back to back{goal}")
        return "\n".join(lines)


def alternate(contenders: dict[str, Callable[[], int]], rounds: int, devices: Iterable[torch.device | str],
              warmup: int = 1, log: Callable[[dict], None] | None = None, progress: bool = False) -> Results:
    """Run every contender ``warmup`` times untimed, then ``rounds`` timed rounds in rotating order.

    Args:
        contenders: name -> function that trains and returns the samples it processed (whole job).
        rounds: timed calls per contender.
        devices: the devices the contenders compute on (synchronised around every timed call).
        warmup: untimed calls per contender first.
        log: called with every record (e.g. ``RunWriter.log``).
        progress: show a tqdm bar (in a terminal only: a notebook keeps plain text, not a half-drawn bar).
    """
    from tqdm.auto import tqdm

    from labkit.train.meters import interactive

    devices = list(devices)
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    results = Results()
    bar = tqdm(total=rounds * len(names), desc="benchmark rounds", disable=not progress or not interactive(), leave=False)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples, wall, cpu = time_call(contenders[name], devices)
            record = {"kind": "bench", "contender": name, "round": r, "samples": samples, "time_s": wall,
                      "cpu_s": cpu, "samples_per_sec": samples / wall}
            results.records.append(record)
            if log is not None:
                log(record)
            bar.update(1)
    bar.close()
    results.records.sort(key=lambda rec: (rec["round"], names.index(rec["contender"])))
    return results


def config_of(args) -> dict:
    """The benchmark's command-line options for ``summary.json`` (without argparse's dispatch entries)."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "bench", "command", "compare_worker")}

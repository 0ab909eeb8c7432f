"""Time every all-reduce algorithm and ``dist.all_reduce`` on this machine, next to the fitted cost model.

    out = run_ranks(bench_rank, 4, ["ring", "tree"], [1 << 10, 16 << 20])[0]
    print(format_table(out["records"]))

The contenders alternate inside each repeat (forward, then backward order) so machine noise hits all of
them alike; the reported time is the median over repeats of the slowest rank, and ``vs_native`` the median
over repeats of (this contender's time / native's time in the same repeat).

The cost model is fitted to point-to-point times taken the same way as the all-reduce times it is compared
with: after a barrier, ``inner`` back-to-back operations timed on the slowest rank, the same number of
repeats, the same quantile. (Timing one call straight after a barrier would add, at small sizes, the wait
for every peer process to be scheduled again; the fit's points do not pay it, so the two would not compare.)
Each record also keeps the lower and upper quartile over the repeats (``q1_s``, ``q3_s``): the spread to draw.
"""
from __future__ import annotations

import re
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from labkit.collectives.cost import busbw, fit_cost_model, ring_formula
from labkit.collectives.execute import all_reduce, traced_run
from labkit.collectives.registry import get_schedule
from labkit.collectives.verify import verify_rank
from labkit.errors import ConfigError
from labkit.train.meters import interactive

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10 ** 3, "MB": 10 ** 6,
          "GB": 10 ** 9}


def parse_size(text: str) -> int:
    """``"64KiB"`` -> 65536; also B, MiB, GiB, KB, MB, GB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match or int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]) < 1:
        raise ConfigError(f"cannot read the size {text!r}; write e.g. 1KiB, 64KiB, 1MiB, 16MiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def format_size(nbytes: int) -> str:
    """65536 -> ``"64KiB"``."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def _timed(fn, device: torch.device) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective is done when the slowest rank is
    return elapsed.item()


def bench_rank(env, algorithms: list[str], sizes: list[int], repeats: int = 5, dtype: str = "float32",
               trace_algorithm: str | None = "ring", verify: bool = False, inner: int = 3,
               quantile: float = 0.5) -> dict:
    """Measure on every rank; returns (on every rank) the fitted model, its points, the records and a trace.

    Args:
        env: this rank's :class:`labkit.dist.group.DistEnv`.
        algorithms: names from :data:`labkit.collectives.ALGORITHMS`; ``"native"`` is always added.
        sizes: vector sizes in bytes.
        repeats: timed runs per contender and size.
        dtype: element type.
        trace_algorithm: also record a step trace of this algorithm at the largest size (None: skip).
        verify: first compare every algorithm with ``dist.all_reduce`` (rows under ``"verify"``), in the
            same processes, which saves starting the ranks twice.
        inner: back-to-back operations per timed sample (its time is their mean), for the fit's messages and
            the all-reduces alike.
        quantile: which quantile over the repeats is reported (0.5: the median), for both alike.
    """
    p, device = env.world_size, env.device
    checked = verify_rank(env, list(algorithms)) if verify else None
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    model, points = fit_cost_model(repeats=repeats, device=device, quantile=quantile, inner=inner)
    contenders = list(dict.fromkeys(list(algorithms) + ["native"]))
    records = []
    progress = tqdm(total=len(sizes) * len(contenders) * repeats, desc=f"all-reduce bench p={p}",
                    disable=not env.is_main or not interactive(), leave=False)  # a notebook keeps plain text
    for nbytes in sizes:
        n = max(1, nbytes // itemsize)
        source = torch.randn(n, dtype=getattr(torch, dtype), device=device)
        buf = source.clone()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for name in contenders:  # warm-up: first-call set-up and the receive workspace
            all_reduce(buf, name)
        for rep in range(repeats):
            for name in (contenders if rep % 2 == 0 else contenders[::-1]):
                buf.copy_(source)
                times[name].append(_timed(lambda: [all_reduce(buf, name) for _ in range(inner)], device) / inner)
                progress.update()
        for name in contenders:
            t = float(np.quantile(times[name], quantile))
            q1, q3 = (float(q) for q in np.quantile(times[name], [0.25, 0.75]))
            reference = "ring" if name == "native" else name  # the model of what native does for large n
            predicted = model.predict(get_schedule(reference, p), n, itemsize)
            records.append({"kind": "bench", "algorithm": name, "world_size": p, "bytes": n * itemsize, "n": n,
                            "dtype": dtype, "time_s": t, "times_s": times[name], "q1_s": q1, "q3_s": q3,
                            "predicted_s": predicted,
                            "seed_formula_s": ring_formula(p, model.transfer_time(n * itemsize / p)),
                            "algbw_GBps": n * itemsize / t / 1e9, "busbw_GBps": busbw(n * itemsize, t, p) / 1e9,
                            "vs_native": statistics.median(a / b for a, b in zip(times[name], times["native"])),
                            "backend": env.backend, "device": str(device)})
    progress.close()
    trace = None
    if trace_algorithm:
        x = torch.randn(max(1, max(sizes) // itemsize), dtype=getattr(torch, dtype), device=device)
        trace = traced_run(x, get_schedule(trace_algorithm, p)).to_record()
    return {"model": {"alpha": model.alpha, "beta": model.beta, "gamma": model.gamma},
            "p2p": [{"bytes": b, "seconds": s} for b, s in points], "records": records, "trace": trace,
            "verify": checked}


def format_table(records: list[dict]) -> str:
    """Predicted vs measured, one line per (world size, size, algorithm)."""
    head = (f"{'p':>2} {'size':>7} {'algorithm':<14} {'measured ms':>12} {'predicted ms':>13} {'busbw GB/s':>11} "
            f"{'/native':>8}")
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r['world_size']:>2} {format_size(r['bytes']):>7} {r['algorithm']:<14} "
                     f"{r['time_s'] * 1e3:>12.3f} {r['predicted_s'] * 1e3:>13.3f} {r['busbw_GBps']:>11.3f} "
                     f"{r['vs_native']:>8.2f}")
    return "\n".join(lines)

"""The two benchmark targets of the all-reduce kit, measured on this machine.

1. Ring executor time / native ``dist.all_reduce`` time at 16 MiB on 2 and 4 gloo ranks (target <= 1.3).
   Both run in the same processes, alternating (ring, native, native, ring, ...), so machine noise hits
   both alike; reported: the ratio of medians and the median of the per-repeat ratios.
2. Rendering a 5-rank ring animation to HTML (target < 10 s), wall and CPU seconds.

    python benchmarks/allreduce_targets.py --repeats 41
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from labkit.collectives import get_schedule
from labkit.collectives.bench import bench_rank
from labkit.dist.testing import run_ranks
from labkit.viz.allreduce import save_animation


def ring_vs_native(world_size: int, repeats: int) -> dict:
    out = run_ranks(bench_rank, world_size, ["ring"], [16 << 20], repeats, "float32", None, timeout=1800)[0]
    times = {r["algorithm"]: r["times_s"] for r in out["records"]}
    ring, native = times["ring"], times["native"]
    return {"ring_ms": statistics.median(ring) * 1e3, "native_ms": statistics.median(native) * 1e3,
            "ratio_of_medians": statistics.median(ring) / statistics.median(native),
            "median_of_ratios": statistics.median(a / b for a, b in zip(ring, native))}


def render_seconds() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        wall, cpu = time.perf_counter(), time.process_time()
        save_animation(get_schedule("ring", 5), Path(tmp) / "ring5.html")
        return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=41)
    args = parser.parse_args()
    for p in (2, 4):
        r = ring_vs_native(p, args.repeats)
        verdict = "ok" if r["median_of_ratios"] <= 1.3 else "ABOVE TARGET"
        print(f"16 MiB, {p} gloo ranks: ring {r['ring_ms']:.1f} ms, native {r['native_ms']:.1f} ms, "
              f"ratio of medians {r['ratio_of_medians']:.2f}, median ratio {r['median_of_ratios']:.2f} "
              f"(target <= 1.3: {verdict})", flush=True)
    wall, cpu = render_seconds()
    print(f"5-rank ring animation to HTML: {wall:.2f} s wall, {cpu:.2f} s CPU "
          f"(target < 10 s: {'ok' if wall < 10 else 'ABOVE TARGET'})")


if __name__ == "__main__":
    main()

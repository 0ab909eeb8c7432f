"""What ``--check-collectives`` costs per collective: 2 local gloo ranks time a small all-reduce called plainly
and through the check, alternated in rounds in the same run (timings on a shared machine are noisy; compare
the two). Reported per call: the median over rounds of each, and their difference, the check's cost.

    python benchmarks/check_collectives.py --calls 200 --rounds 7 --numel 1000
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from labkit.faults.runner import run_script

#: the script each rank runs under ``labkit doctor --check-collectives``: ``dist.all_reduce`` is the checked
#: call, its ``labkit_checked`` attribute the plain one
PROGRAM = """
import statistics, sys, time
import torch
import torch.distributed as dist

calls, rounds, numel = map(int, sys.argv[1:])
dist.init_process_group("gloo")
checked = dist.all_reduce
plain = checked.labkit_checked
t = torch.ones(numel)
times = {"plain": [], "checked": []}
for _ in range(rounds):
    for name, fn in (("plain", plain), ("checked", checked)):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn(t)
        times[name].append((time.perf_counter() - start) / calls * 1e6)
if dist.get_rank() == 0:
    plain, checked = statistics.median(times["plain"]), statistics.median(times["checked"])
    print(f"all_reduce of {numel} float32 on 2 gloo ranks: plain {plain:.0f} us, checked {checked:.0f} us "
          f"per call; the check adds {checked - plain:.0f} us")
dist.destroy_process_group()
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--numel", type=int, default=1000)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "timed.py"
        script.write_text(PROGRAM)
        ranks = run_script(["--watchdog", "0", "--check-collectives", str(script), str(args.calls),
                            str(args.rounds), str(args.numel)], timeout=600)
    for rank, (code, out) in ranks.items():
        if code != 0:
            print(f"rank {rank} exited {code}:\n{out}", file=sys.stderr)
            return 1
    print(ranks[0][1], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

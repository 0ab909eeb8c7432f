"""How fast the ``labkit`` command answers ``--help`` and argument errors (target <= 0.5 s each).

Each command runs as a fresh ``python -m labkit ...`` process, so interpreter start-up and imports are
counted the way a user meets them. The reference contender is ``python -c "import torch"``: a command that
imports torch cannot answer faster than that. Contenders alternate in every round so the noise of a shared
machine hits them alike; reported: median and max wall seconds, and whether torch was imported.

    python benchmarks/cli_startup.py --repeats 7
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from labkit.bench import BENCHMARKS

COMMANDS = [
    ["--help"],
    ["tour", "--help"],
    ["data", "--help"],
    ["data", "list", "--help"],
    ["allreduce", "--help"],
    ["allreduce", "verify", "--help"],
    ["allreduce", "animate", "--ranks", "x"],
    ["bench", "--help"],
    ["bench", "nosuch"],
    ["check", "--help"],
    ["train", "--help"],
    ["train", "--strategy", "ddp", "--epochs", "x"],
    *(["bench", name, "--help"] for name in BENCHMARKS),
    ["bench", "gpipe", "--steps", "x"],
]
_PROBE = ("import runpy, sys; sys.argv = ['labkit', *sys.argv[1:]]\n"
          "try:\n    runpy.run_module('labkit', run_name='__main__')\n"
          "except SystemExit:\n    pass\n"
          "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)")


def once(argv: list[str]) -> tuple[float, bool]:
    """Wall seconds of one ``labkit ARGV`` process, and whether it imported torch."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    return time.perf_counter() - start, "torch imported" in proc.stderr.splitlines()[-1]


def torch_import() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {" ".join(c): [] for c in COMMANDS}
    torch_flag: dict[str, bool] = {}
    reference: list[float] = []
    for _ in range(args.repeats):
        reference.append(torch_import())
        for argv in COMMANDS:
            seconds, imported = once(argv)
            times[" ".join(argv)].append(seconds)
            torch_flag[" ".join(argv)] = imported
    print(f"{'labkit ...':<36}{'median s':>10}{'max s':>8}  torch")
    for name, ts in times.items():
        verdict = "imported" if torch_flag[name] else "-"
        print(f"{name:<36}{statistics.median(ts):>10.3f}{max(ts):>8.3f}  {verdict}")
    label = "(python -c 'import torch')"
    print(f"{label:<36}{statistics.median(reference):>10.3f}{max(reference):>8.3f}")


if __name__ == "__main__":
    main()

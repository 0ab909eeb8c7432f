"""Parameter server vs all-reduce: samples/s and time to a target accuracy, with and without a straggler.

    labkit bench ps                                  # 2 workers: DDP, PS sync, async, SSP (K=1), ± straggler
    labkit bench ps --workers 3 --slow-factor 4 --epochs 4 --target-acc 0.9

Every contender is a real ``labkit train`` job under torchrun on this machine: DDP on W ranks, the
parameter server on 1 + W ranks (rank 0 serves, the W workers compute). With ``--slow-factor F`` the last
worker sleeps F − 1 times its own step before each step (``--ps-slow-worker``): synchronous training waits
for it every round, asynchronous training does not, and pays in staleness. DDP has no straggler switch and
runs without one. Contenders alternate in order between rounds; the reported numbers are medians over
rounds. *samples/s* is training throughput (all workers together); *time to target* the wall time until
the test accuracy first reaches ``--target-acc`` (evaluation after each epoch), or none. Every contender
gets ``--base-lr`` and momentum 0.9; the async and SSP servers take off the momentum asynchrony adds
(:mod:`labkit.strategies.ps.strategy`), without which SSP at lr 0.05 diverged.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from labkit.errors import ConfigError

#: ``labkit bench ps`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--workers", "type": "int", "range": "[1, inf)", "default": 2, "help": "worker ranks (DDP ranks)"},
    {"flag": "--model", "default": "lenet", "help": "labkit model"},
    {"flag": "--dataset", "default": "mnist-sample", "help": "dataset"},
    {"flag": "--epochs", "type": "int", "range": "[1, inf)", "default": 3, "help": "epochs of every run"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 32, "help": "samples per worker per step"},
    {"flag": "--base-lr", "type": "float", "range": "(0, inf)", "default": 0.05, "help": "learning rate"},
    {"flag": "--train-size", "type": "int", "range": "[1, inf)", "default": 2048, "help": "first N training samples"},
    {"flag": "--test-size", "type": "int", "range": "[1, inf)", "default": 500,
     "help": "test samples evaluated after each epoch"},
    {"flag": "--max-staleness", "type": "int", "range": "[0, inf)", "default": 1, "help": "K of the SSP contender"},
    {"flag": "--slow-factor", "type": "float", "range": "[1, inf)", "default": 3.0,
     "help": "straggler factor (1 = no straggler runs)"},
    {"flag": "--target-acc", "type": "float", "range": "(0, 1]", "default": 0.8,
     "help": "test accuracy of the time-to-target column"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 1,
     "help": "rounds (each runs every contender)"},
    {"flag": "--out", "default": "runs/bench-ps", "help": "results folder"},
]


def contenders(args) -> dict[str, tuple[int, list[str]]]:
    """name -> (ranks, strategy flags)."""
    w = args.workers
    out = {"ddp": (w, ["--strategy", "ddp"])}
    for slow in ([False, True] if args.slow_factor > 1 else [False]):
        for mode in ("sync", "async", "ssp"):
            flags = ["--strategy", "ps", "--ps-mode", mode]
            flags += ["--max-staleness", str(args.max_staleness)] if mode == "ssp" else []
            flags += ["--ps-slow-worker", f"{w}:{args.slow_factor:g}"] if slow else []
            out[f"ps-{mode}" + (" +straggler" if slow else "")] = (w + 1, flags)
    return out


def time_to_target(epochs: list[dict], target: float) -> float | None:
    """Wall seconds of training until the first epoch whose test accuracy reaches ``target``."""
    elapsed = 0.0
    for record in epochs:
        elapsed += record["time_s"]
        if record["test_acc"] >= target:
            return elapsed
    return None


def main(args: argparse.Namespace) -> int:
    from labkit.bench.harness import config_of
    from labkit.launch.local import torchrun
    from labkit.results import RunWriter

    if args.workers < 1 or args.rounds < 1 or args.slow_factor < 1:
        raise ConfigError("--workers and --rounds must be >= 1, --slow-factor >= 1")
    out = Path(args.out)
    writer = RunWriter(out)
    common = ["--model", args.model, "--dataset", args.dataset, "--epochs", str(args.epochs), "--batch-size",
              str(args.batch_size), "--base-lr", str(args.base_lr), "--train-size", str(args.train_size),
              "--test-size", str(args.test_size), "--device", "cpu", "--backend", "gloo", "--no-checkpoint",
              "--log-every", "1000000"]
    runs = contenders(args)
    measured: dict[str, list[dict]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            nproc, flags = runs[name]
            folder = out / f"{name.replace(' +', '-')}-round{r}"
            record = ["--ps-record", str(folder / "ps-record.json")] if "ps" in flags else []
            run = torchrun(["train", *flags, *common, *record, "--out", str(folder)], nproc=nproc, echo=None)
            epochs = run.records_of("epoch")
            staleness = []
            if record:
                for server in json.loads((folder / "ps-record.json").read_text())["per_server"]:
                    staleness += [u["staleness"] for u in server["updates"]]
            measured[name].append({"samples_per_sec": run.summary["metrics"]["samples_per_sec"],
                                   "time_to_target_s": time_to_target(epochs, args.target_acc),
                                   "final_test_acc": epochs[-1]["test_acc"],
                                   "mean_staleness": statistics.fmean(staleness) if staleness else 0.0,
                                   "max_staleness": max(staleness, default=0)})
            print(f"  {name}: round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{'contender':<22}{'samples/s':>11}{'to ' + format(args.target_acc, '.0%'):>10}{'final acc':>11}"
          f"{'staleness':>11}")
    summary = {}
    for name, rows in measured.items():
        times = [t["time_to_target_s"] for t in rows if t["time_to_target_s"] is not None]
        row = {"kind": "bench", "contender": name, "ranks": runs[name][0],
               "samples_per_sec": statistics.median(t["samples_per_sec"] for t in rows),
               "time_to_target_s": statistics.median(times) if len(times) == len(rows) else None,
               "final_test_acc": statistics.median(t["final_test_acc"] for t in rows),
               "mean_staleness": statistics.median(t["mean_staleness"] for t in rows),
               "max_staleness": max(t["max_staleness"] for t in rows)}
        writer.log(row)
        summary[name] = row
        to_target = "-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.1f} s"
        print(f"{name:<22}{row['samples_per_sec']:>11.0f}{to_target:>10}{row['final_test_acc']:>11.3f}"
              f"{row['mean_staleness']:>11.2f}")
    writer.finish("bench-ps", "bench", config_of(args), {"contenders": summary})
    print(f"results in {out}/summary.json (each run in its own folder, PS records in ps-record.json)")
    return 0

"""``labkit bench suite``: every strategy on the same model and data, plus the kit's benchmarks, in one folder.

    labkit bench suite --quick                      # a few CPU minutes; what results/reference/ holds
    labkit bench suite --out runs/suite-h100        # the full suite on a GPU node
    labkit bench report runs/suite-h100 results/reference/cpu-2c-torch2.14.1

Parts, each a real run whose own results folder is kept under ``--out``:

- strategies: ``labkit train`` with every strategy whose module declares a ``BENCH`` literal (its ranks and extra
  flags, :func:`strategy_runs`) on LeNet / mnist-sample, batch 64 per data-parallel rank (single; ddp, hybrid,
  tensor-parallel, pipeline, zero (stage 3) and fsdp on 2 ranks; model-parallel and gpipe driving 2 devices from
  one process): samples/s, peak memory, test accuracy after each epoch and the time it took. The
  hybrid strategy needs a model split into convolutional features and FC classifier: it trains
  alexnet_small on synthetic-cifar10, and the report names it so;
- benchmarks on the shared harness: labkit vs plain PyTorch on one device and under DDP (with the 1 → 2 rank
  scaling), labkit's GPipe vs raw torchgpipe, K-FAC step time vs SGD, and the all-reduce algorithms.

``suite.json`` gathers the numbers with the machine's tag (device, torch / CUDA / NCCL versions), so runs
from different machines can be plotted side by side (:mod:`labkit.bench.report`). A part that fails is
recorded with its error and the suite goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

from labkit.train.peak import device_name

SUITE_FILE = "suite.json"


def strategy_runs() -> dict[str, tuple[int, list[str]]]:
    """``{strategy: (ranks, extra labkit train flags)}`` from each strategy module's ``BENCH`` literal
    (``{"ranks": 2, "flags": [...]}``, read without importing the module), in registry order."""
    from labkit.strategies import registered

    return {name: (int(b["ranks"]), list(b.get("flags", []))) for name, b in registered("BENCH").items()}


def parts() -> list[str]:
    """Every part of the suite: the strategies' runs, then the benchmarks."""
    return [*strategy_runs(), *BENCHES]


#: ``labkit bench suite`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--quick", "action": "store_true", "help": "short runs (minutes on a laptop CPU)"},
    {"flag": "--only", "nargs": "+", "default": None, "metavar": "PART",
     "help": "run only these parts: the strategies with a BENCH entry in their module (single, ddp, hybrid, "
             "tensor-parallel, ...), bench-single, bench-ddp, bench-gpipe, bench-kfac, allreduce"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": None, "help": "results folder (default: runs/suite-<machine tag>)"},
]


def machine() -> dict:
    """What the numbers were measured on: device, core count, torch / CUDA / NCCL versions."""
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else None
    return {"device": torch.cuda.get_device_name(0) if cuda else device_name(torch.device("cpu")), "gpus": torch.cuda.device_count(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "nccl": nccl, "python": platform.python_version()}


def machine_tag(info: dict | None = None) -> str:
    """A folder name for the machine, e.g. ``cpu-2c-torch2.14.1`` or ``nvidia-h100-80gb-hbm3-x1-cuda12.8-torch2.14.1``."""
    info = info or machine()
    torch_version = info["torch"].split("+")[0]
    if info["gpus"]:
        name = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-")
        return f"{name}-x{info['gpus']}-cuda{info['cuda']}-torch{torch_version}"
    return f"cpu-{info['cpu_count']}c-torch{torch_version}"


def _labkit(args: list[str], nproc: int, out: Path) -> dict:
    """Run ``labkit ARGS --out OUT`` (under torchrun for several ranks); return its summary."""
    from labkit.launch.common import RunFailed
    from labkit.launch.local import torchrun
    from labkit.results import load_run

    args = [*args, "--out", str(out)]
    # one thread per process: a CPU core stands for one device, and oversubscribed threads spin-wait
    threads = {} if torch.cuda.is_available() else {"OMP_NUM_THREADS": "1"}
    if nproc > 1:
        return torchrun(args, nproc=nproc, env=threads, echo=None).summary
    proc = subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **threads})
    if proc.returncode != 0:
        raise RunFailed(f"labkit {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-1500:]}")
    return load_run(out).summary


def strategy_part(name: str, quick: bool, device: str, out: Path) -> dict:
    """One ``labkit train`` run of strategy ``name``; its throughput, MFU and HFU (and the peak they divide by),
    memory and accuracy-over-time."""
    from labkit.results import load_run

    ranks, extra = strategy_runs()[name]
    steps = ["--epochs", "1", "--max-steps", "30", "--test-size", "500"] if quick else ["--epochs", "3"]
    args = ["train", "--strategy", name, "--model", "lenet", "--dataset", "mnist-sample", "--batch-size", "64",
            "--device", device, "--no-checkpoint", "--log-every", "1000", *steps, *extra]
    summary = _labkit(args, ranks, out / "strategies" / name)
    epochs = [{k: r[k] for k in ("epoch", "test_acc", "time_s", "samples_per_sec")}
              for r in load_run(out / "strategies" / name).records_of("epoch")]
    metrics = summary["metrics"]
    config = summary["config"]
    return {"ranks": ranks, "model": config["model"], "dataset": config["dataset"], "samples_per_sec": metrics["samples_per_sec"], "peak_memory_gb": metrics["peak_memory_gb"],
            "memory_lines": metrics["memory_lines"], "final_test_acc": metrics["final_test_acc"], "epochs": epochs,
            "mfu": metrics.get("mfu"), "hfu": metrics.get("hfu"), "peak": (metrics.get("flops") or {}).get("peak_source")}


BENCHES: dict[str, list[str]] = {  # name -> quick command line; a full run appends _FULL's flags (the last wins)
    "bench-single": ["bench", "single", "--rounds", "6"],
    "bench-ddp": ["bench", "ddp", "--ranks", "1,2", "--rounds", "6"],
    "bench-gpipe": ["bench", "gpipe", "compare", "--model", "lenet", "--chunks", "4", "--steps", "8", "--rounds", "4"],
    "bench-kfac": ["bench", "kfac", "--models", "lenet", "--steps", "10", "--rounds", "2"],
    "allreduce": ["allreduce", "bench", "--ranks", "2", "--sizes", "1KiB,64KiB,1MiB", "--repeats", "3"],
}
_FULL = {"bench-single": ["--rounds", "12"], "bench-ddp": ["--ranks", "1,2,4", "--rounds", "12"],
         "bench-gpipe": ["--model", "resnet20", "--rounds", "8"], "bench-kfac": ["--models", "lenet", "resnet20"],
         "allreduce": ["--ranks", "2,4", "--sizes", "1KiB,64KiB,1MiB,16MiB"]}


def bench_part(name: str, quick: bool, device: str, out: Path) -> dict:
    """One benchmark; its summary metrics."""
    args = list(BENCHES[name]) + ([] if quick else _FULL[name])
    if name != "allreduce":
        args += ["--device", device]
    return _labkit(args, 1, out / name)["metrics"]


def run_suite(quick: bool, device: str, out: Path, only: list[str] | None = None) -> dict:
    """Run the parts (all, or ``only``) and write ``out/suite.json``; return its content."""
    from tqdm.auto import tqdm

    from labkit.errors import ConfigError
    from labkit.results import atomic_write_text

    runs, names = strategy_runs(), parts()
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ConfigError(f"unknown suite part(s) {', '.join(unknown)}; choose from: {', '.join(names)}")
    info = machine()
    suite = {"kind": "suite", "tag": machine_tag(info), "quick": quick, "machine": info, "strategies": {},
             "benches": {}}
    out.mkdir(parents=True, exist_ok=True)
    for part in tqdm([p for p in names if not only or p in only], desc="bench suite"):
        section, run = (("strategies", strategy_part) if part in runs else ("benches", bench_part))
        try:
            suite[section][part] = run(part, quick, device, out)
        except Exception as exc:  # a failing part is a result too: recorded, and the others still run
            suite[section][part] = {"error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
            print(f"{part}: FAILED ({type(exc).__name__}); see suite.json", flush=True)
    atomic_write_text(out / SUITE_FILE, json.dumps(suite, indent=1, default=str) + "\n")
    return suite


def main(args: argparse.Namespace) -> int:
    out = Path(args.out or Path("runs") / f"suite-{machine_tag()}")
    suite = run_suite(args.quick, args.device, out, args.only)
    failed = [k for section in ("strategies", "benches") for k, v in suite[section].items() if "error" in v]
    print(f"suite for {suite['tag']} written to {out / SUITE_FILE}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    print(f"plot it: labkit bench report {out}")
    return 1 if failed else 0

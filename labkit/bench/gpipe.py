"""GPipe: labkit's GPipe trainer against a raw torchgpipe loop, and the micro-batch sweep.

    labkit bench gpipe compare --model resnet50 --batch-size 64 --chunks 4 --steps 6 --rounds 3
    labkit bench gpipe sweep --model resnet50 --batch-size 128 --chunks 1 2 4 8 --checkpoint always never
    labkit bench gpipe point --chunks 4 --checkpoint never      # one sweep point (what sweep runs)

``compare``: the same model, balance, chunks and checkpoint mode; the trainer is ``labkit.train.loop.fit`` with
:class:`~labkit.strategies.gpipe.GPipeStrategy` and ``--loader``'s data path, the raw loop (``raw``) is the
torchgpipe tutorial's loop over the dataset preloaded as one tensor, on the same kind of pipeline (built by
:func:`~labkit.strategies.gpipe.make_gpipe`: on CPU its tasks run on the calling thread, see
:mod:`labkit.strategies.gpipe_workers`), so the ratio is the trainer's own cost. On CPU a third contender,
``raw-threads``, runs the same loop on a plain ``torchgpipe.GPipe`` (torchgpipe's execution: a worker thread
per device, started in every forward), what a script using torchgpipe directly gets; its ratio to ``raw`` is
what the inline execution saves. They alternate round by round (:mod:`labkit.bench.harness`); the result is
the median of the per-round ratios labkit / raw (target >= 0.97), printed with their spread and the ratio of
CPU seconds (robust when other jobs share the machine).

``sweep``: every (chunks, checkpoint) point runs in a fresh process, so each peak memory is its own:
on GPUs the largest ``max_memory_allocated`` over the partitions' devices; on CPU the process peak RSS
minus the RSS just before the first step (that difference is what training added: activations,
gradients and optimizer state, the same for every point but the activations).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from itertools import product

import torch
from torch import nn
from torchgpipe import GPipe

from labkit.bench.harness import config_of, sync
from labkit.data import loader as loaders
from labkit.strategies.balance import compute_balance
from labkit.strategies.gpipe import gpipe_devices, make_gpipe

GB = 1024 ** 3
TARGET = 0.97


#: ``labkit bench gpipe`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "mode", "nargs": "?", "choices": ["compare", "sweep", "point"], "default": "compare",
     "help": "compare (labkit vs raw torchgpipe), sweep (micro-batches x checkpoint modes), point (one sweep point)"},
    {"flag": "--model", "default": "resnet50", "help": "labkit model"},
    {"flag": "--dataset", "default": "mnist-sample", "help": "dataset"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 64, "help": "samples per step"},
    {"flag": "--chunks", "type": "int", "range": "[1, inf)", "nargs": "+", "default": [4],
     "help": "micro-batches (several for sweep)"},
    {"flag": "--checkpoint", "nargs": "+", "choices": ["always", "except_last", "never"], "default": ["except_last"],
     "help": "recompute activations in backward (several for sweep)"},
    {"flag": "--partitions", "type": "int", "range": "[1, inf)", "default": None,
     "help": "partitions (default: every GPU, or 2 on CPU)"},
    {"flag": "--balance", "type": "int", "range": "[1, inf)", "nargs": "+", "default": None,
     "help": "layers per partition (default: measured by time once)"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 6,
     "help": "timed steps per contender per round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 6,
     "help": "timed rounds (each runs both contenders)"},
    {"flag": "--loader", "default": "tensor", "choices": ["tensor", "torch"], "help": "compare: labkit's data path"},
    {"flag": "--threads", "type": "int", "range": "[1, inf)", "default": None,
     "help": "CPU threads (default: torch's choice)"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": "runs/bench-gpipe", "help": "results folder"},
]


def _setup(args: argparse.Namespace):
    from labkit.data import datasets as data
    from labkit.dist.launch_info import resolve_device
    from labkit.models import cnn as models

    device = resolve_device(args.device)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    devices = gpipe_devices(args.partitions, device)
    info = data.dataset_info(args.dataset)
    batches = [b for _, b in zip(range(args.steps + 1), loaders.make_loader(
        data.get_dataset(args.dataset, train=True), args.batch_size, shuffle=True, seed=0, drop_last=True))]

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return models.get_model(args.model, info.num_classes, info.in_channels, info.image_size, sequential=True)

    balance = args.balance or compute_balance("time", len(devices), model(), batches[0][0], args.chunks[0], devices[0])
    return device, devices, batches, model, balance


def raw_steps(gpipe, batches, optimizer) -> int:
    """The torchgpipe tutorial's loop: input to the first device, target to the last. Returns samples."""
    in_device, out_device = gpipe.devices[0], gpipe.devices[-1]
    for x, y in batches:
        x, y = x.to(in_device, non_blocking=True), y.to(out_device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(gpipe(x), y)
        loss.backward()
        optimizer.step()
    return sum(len(x) for x, _ in batches)


def compare(args: argparse.Namespace) -> int:
    """labkit's GPipe strategy through fit vs the raw torchgpipe loop over preloaded tensors, alternated."""
    from labkit.bench.contenders import PlainLoop, labkit_fit, preload
    from labkit.bench.harness import alternate
    from labkit.data.tensor import load_split
    from labkit.dist.group import DistEnv
    from labkit.results import RunWriter
    from labkit.strategies.gpipe import GPipeStrategy

    device, devices, _, model, balance = _setup(argparse.Namespace(**{**vars(args), "steps": 0}))
    chunks, checkpoint = args.chunks[0], args.checkpoint[0]
    strategy = GPipeStrategy(DistEnv(device=device), {"num_microbatches": chunks, "checkpoint_mode": checkpoint,
                                                      "balance": balance, "partitions": len(balance)})
    loader = loaders.make_loader(load_split(args.loader, args.dataset, True, device=strategy.input_device),
                              args.batch_size, shuffle=True, drop_last=True)
    x, y = preload(args.dataset, devices[0])
    raw = make_gpipe(model(), devices, chunks, checkpoint, balance)
    contenders = {"labkit": labkit_fit(strategy.prepare(model()), loader, strategy, args.steps),
                  "raw": PlainLoop(raw, x, y.to(devices[-1]), args.batch_size, args.steps)}
    cpu = all(d.type == "cpu" for d in raw.devices)
    execution = dict.fromkeys(contenders, "inline (calling thread)" if cpu else "torchgpipe worker threads")
    if cpu:  # on GPUs labkit's pipeline already is torchgpipe's: a third contender would repeat raw
        threads = GPipe(model(), balance, devices=raw.devices, chunks=chunks, checkpoint=checkpoint)
        contenders["raw-threads"] = PlainLoop(threads, x, y.to(devices[-1]), args.batch_size, args.steps)
        execution["raw-threads"] = "torchgpipe worker threads (plain torchgpipe.GPipe)"
    writer = RunWriter(args.out)
    results = alternate(contenders, args.rounds, devices, log=writer.log)
    print(f"GPipe {args.model}, batch {args.batch_size}, {chunks} micro-batches, checkpoint {checkpoint}, "
          f"balance {balance} on {', '.join(map(str, devices))}")
    print(results.table("raw", TARGET))
    print("execution: " + "; ".join(f"{name} {how}" for name, how in execution.items()))
    summary = results.summary("raw")
    writer.finish("bench-gpipe-compare", "bench", _config(args, balance),
                  {**summary, "labkit_samples_per_sec": summary["labkit"]["median_samples_per_sec"],
                   "raw_samples_per_sec": summary["raw"]["median_samples_per_sec"], "ratio": summary["labkit"]["ratio"],
                   "samples_per_sec": summary["labkit"]["median_samples_per_sec"], "execution": execution},
                  DistEnv(device=device))
    print(f"results written to {args.out}/summary.json")
    return 0


def point(args: argparse.Namespace) -> dict:
    """One (chunks, checkpoint) configuration in this process: samples/s and peak memory."""
    from labkit.train.meters import process_memory_gb

    _, devices, batches, model, balance = _setup(args)
    chunks, checkpoint = args.chunks[0], args.checkpoint[0]
    gpipe = make_gpipe(model(), devices, chunks, checkpoint, balance)
    optimizer = torch.optim.SGD(gpipe.parameters(), lr=0.01, momentum=0.9)
    before = process_memory_gb()[0]
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.reset_peak_memory_stats(d)
    raw_steps(gpipe, batches[:1], optimizer)
    sync(devices)
    start = time.perf_counter()
    seen = raw_steps(gpipe, batches[1:], optimizer)
    sync(devices)
    rate = seen / (time.perf_counter() - start)
    gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if gpus:
        per_device = [torch.cuda.max_memory_allocated(d) / GB for d in gpus]
        peak, memory = max(per_device), {"per_device_peak_gb": per_device, "memory_kind": "cuda max allocated"}
    else:
        peak = process_memory_gb()[1] - before
        memory = {"rss_before_gb": before, "memory_kind": "process peak RSS minus RSS before training"}
    return {"kind": "bench", "chunks": chunks, "checkpoint": checkpoint, "batch_size": args.batch_size,
            "balance": balance, "samples_per_sec": rate, "peak_memory_gb": peak, **memory}


def sweep(args: argparse.Namespace) -> int:
    from labkit.results import RunWriter

    *_, balance = _setup(argparse.Namespace(**{**vars(args), "steps": 0}))
    writer = RunWriter(args.out)
    records = []
    print(f"GPipe sweep: {args.model}, batch {args.batch_size}, balance {balance}, each point in a fresh process")
    print(f"{'chunks':>6} {'checkpoint':>12} {'samples/s':>10} {'peak GB':>8}")
    for chunks, mode in product(args.chunks, args.checkpoint):
        cmd = [sys.executable, "-m", "labkit", "bench", "gpipe", "point", "--model", args.model, "--dataset",
               args.dataset, "--batch-size", str(args.batch_size), "--chunks", str(chunks), "--checkpoint", mode,
               "--steps", str(args.steps), "--device", args.device, "--balance", *map(str, balance)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # failures reported below
        if proc.returncode != 0:
            raise RuntimeError(f"sweep point chunks={chunks} checkpoint={mode} failed:\n{proc.stderr[-2000:]}")
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        records.append(record)
        writer.log(record)
        print(f"{chunks:>6} {mode:>12} {record['samples_per_sec']:>10.2f} {record['peak_memory_gb']:>8.3f}")
    best = max(records, key=lambda r: r["samples_per_sec"])
    writer.finish("bench-gpipe-sweep", "bench", _config(args, balance),
                  {"samples_per_sec": best["samples_per_sec"], "best_chunks": best["chunks"],
                   "best_checkpoint": best["checkpoint"], "points": records})
    print(f"results written to {args.out}/summary.json (records of kind 'bench' in metrics.jsonl)")
    return 0


def _config(args: argparse.Namespace, balance: list[int]) -> dict:
    return {**config_of(args), "balance": balance}


def main(args: argparse.Namespace) -> int:
    if args.mode == "point":
        print(json.dumps(point(args)))
        return 0
    return compare(args) if args.mode == "compare" else sweep(args)

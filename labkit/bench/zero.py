"""ZeRO stages 1-3 and FSDP2 vs plain PyTorch DDP: samples/s, collectives per step and training-state memory per rank,
beside ZeRO's formulas.

    labkit bench zero --ranks 2 --model lenet --dataset mnist-sample --optimizer sgd --steps 20 --rounds 8
    labkit bench zero --ranks 2 --model gpt-tiny --dataset text-sample --seq-len 64 --batch-size 8
    labkit bench zero --ranks 2,4,8 --model resnet20 --dataset synthetic-cifar10 --device cuda

For each rank count one job runs under torchrun; inside it every contender is built once and the harness
alternates them round by round (:mod:`labkit.bench.harness`), each call ``--steps`` steps: ``plain`` is
PyTorch's DistributedDataParallel in the textbook loop over the dataset preloaded as one tensor (every rank its
shard of a shared permutation); ``ddp``, ``zero-1``, ``zero-2``, ``zero-3`` (a bucket ahead, ``--zero-prefetch``)
and ``fsdp`` train through :func:`labkit.train.loop.fit` over the same resident tensors, ZeRO in buckets of
``--bucket-mb``; ``zero-2/layer`` is ZeRO-2 with one bucket per layer (what it sent before buckets). The ratio to
plain is the median over rounds of each back-to-back pair. Targets: ZeRO-1 and ZeRO-2 >= 0.95 of plain, ZeRO-3
>= 0.85. Collectives per step are counted (ZeRO's :class:`~labkit.parallel.zero_units.Comm`), not timed; what
one bucket's all-reduce, reduce-scatter and all-gather cost on the backend is timed beside them
(:func:`labkit.lab.sharding.collective_costs`): where ZeRO's pair costs more than DDP's all-reduce, no bucketing
closes the gap.

Memory is what each rank holds after a step, counted tensor by tensor (parameters, gradients, optimizer state),
largest over the ranks, beside the formula of :mod:`labkit.parallel.zero` with Ψ the model's parameters, N the
ranks, K = 4 (SGD + momentum) or 8 (Adam) bytes of optimizer state per parameter. Target: measured within 15 % of
the formula. On GPUs the peak allocated memory of each contender's step (``torch.cuda.max_memory_allocated``) is
reported too; on a CPU one process runs every contender, so its peak is not theirs and is left out.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

TARGET = 0.15
#: samples/s of a contender over plain DDP's it should reach
SPEED_TARGETS = {"zero-1": 0.95, "zero-2": 0.95, "zero-3": 0.85}
#: one bucket per layer: a cap below any layer's bytes
PER_LAYER_MB = 1e-6


#: ``labkit bench zero`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--ranks", "default": "2,4", "help": "rank counts, e.g. 2,4"},
    {"flag": "--model", "default": "mlp", "help": "model to train (mlp: 0.67 M parameters)"},
    {"flag": "--dataset", "default": "synthetic-mnist", "help": "dataset"},
    {"flag": "--optimizer", "default": "adam", "choices": ["sgd", "adam"], "help": "sgd (with momentum) or adam"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 32, "help": "samples per rank per step"},
    {"flag": "--bucket-mb", "type": "float", "range": "(0, 1e6]", "default": 25.0,
     "help": "ZeRO's bucket size in MB (as DDP's bucket_cap_mb)"},
    {"flag": "--seq-len", "type": "int", "range": "[1, 65536]", "default": 64, "help": "a language model's tokens per sequence"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 5,
     "help": "optimizer steps per contender and round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 3,
     "help": "timed rounds (each runs every contender)"},
    {"flag": "--device", "default": "cpu", "help": "cpu (gloo) or cuda (NCCL, one rank per GPU)"},
    {"flag": "--out", "default": "runs/bench-zero", "help": "results folder (one sub-folder per rank count)"},
    {"flag": "--worker", "action": "store_true", "hidden": True, "help": "one rank of one job"},
]


def formula_bytes(contender: str, psi: int, world: int, k: int) -> dict[str, float]:
    """ZeRO's per-rank bytes in fp32: ``{"params", "grads", "optimizer"}`` (see :mod:`labkit.parallel.zero`)."""
    stage = {"ddp": 0, "zero-1": 1, "zero-2": 2, "zero-2/layer": 2, "zero-3": 3, "fsdp": 3}[contender]
    return {"params": 4 * psi / (world if stage >= 3 else 1), "grads": 4 * psi / (world if stage >= 2 else 1),
            "optimizer": k * psi / (world if stage >= 1 else 1)}


def main(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from labkit.bench.ddp import parse_ranks
    from labkit.launch.local import torchrun

    for n in parse_ranks(args.ranks):
        torchrun(["bench", "zero", "--worker", "--model", args.model, "--dataset", args.dataset, "--optimizer",
                  args.optimizer, "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--rounds",
                  str(args.rounds), "--device", args.device, "--bucket-mb", str(args.bucket_mb), "--seq-len",
                  str(args.seq_len), "--out", f"{args.out}/ranks-{n}"], nproc=n)
    return 0


def contenders(bucket_mb: float) -> dict[str, tuple[str, dict]]:
    """labkit's contenders: ``{name: (strategy, options)}``, ZeRO in buckets of ``bucket_mb``."""
    return {"ddp": ("ddp", {}), "zero-1": ("zero", {"zero_stage": 1, "bucket_mb": bucket_mb}),
            "zero-2": ("zero", {"zero_stage": 2, "bucket_mb": bucket_mb}),
            "zero-3": ("zero", {"zero_stage": 3, "bucket_mb": bucket_mb, "zero_prefetch": True}),
            "zero-2/layer": ("zero", {"zero_stage": 2, "bucket_mb": PER_LAYER_MB}), "fsdp": ("fsdp", {})}


def _worker(args: argparse.Namespace) -> int:
    from torch.nn.parallel import DistributedDataParallel

    from labkit.bench.contenders import PlainLoop, preload
    from labkit.bench.harness import alternate, config_of
    from labkit.data import datasets as data
    from labkit.data import loader as loaders
    from labkit.data.tensor import load_split
    from labkit.dist import group as kdist
    from labkit.dist.group import distributed, print0
    from labkit.lab.sharding import collective_costs, held_bytes
    from labkit.models import cnn as models
    from labkit.optim import OptimizerSpec
    from labkit.results import RunWriter
    from labkit.strategies import backends, get_strategy
    from labkit.train.loop import fit
    from labkit.train.tasks import get_task

    with distributed(backends.auto_device("zero", None, args.device), refusal=backends.refusal_of("zero")) as env:
        info = data.dataset_info(args.dataset)
        lm = info.task == "lm"
        train_set = load_split("tensor", args.dataset, True, device=env.device, seq_len=args.seq_len if lm else None)
        task = get_task("lm") if lm else None
        torch.manual_seed(0)
        template = (models.get_model(args.model, info.num_classes, seq_len=args.seq_len) if lm else
                    models.get_model(args.model, info.num_classes, info.in_channels, info.image_size))
        psi = sum(p.numel() for p in template.parameters() if p.requires_grad)
        runs = {}
        for name, (strategy_name, options) in contenders(args.bucket_mb).items():
            strategy = get_strategy(strategy_name)(env, options)
            model = strategy.prepare(copy.deepcopy(template).to(env.device))
            optimizer, _ = strategy.build_optimizer(model, OptimizerSpec(args.optimizer, 0.01, 0.9, 0.0, {}, env))
            loader = loaders.make_loader(train_set, args.batch_size, shuffle=True,
                                         sampler=strategy.sampler(train_set, True, 0), drop_last=True)
            runs[name] = (strategy, model, optimizer, loader)
        x, y = (train_set.data, train_set.targets) if lm else preload(args.dataset, env.device)
        plain = DistributedDataParallel(copy.deepcopy(template).to(env.device),
                                        device_ids=[env.device.index] if env.device.type == "cuda" else None)
        plain_loop = PlainLoop(plain, x, y, args.batch_size, args.steps, env.rank, env.world_size,
                               optimizer=args.optimizer)

        def contender(name):
            strategy, model, optimizer, loader = runs[name]

            def call() -> int:
                fit(model, loader, None, optimizer, epochs=1, strategy=strategy, max_steps=args.steps,
                    log_every=10 ** 9, printer=lambda line: None, task=task)
                return args.steps * args.batch_size * env.world_size
            return call

        calls = {n: runs[n][0].comm.calls for n in runs if runs[n][0].name == "zero"}
        writer = RunWriter(args.out, enabled=env.is_main)
        results = alternate({"plain": plain_loop, **{n: contender(n) for n in runs}}, args.rounds, [env.device],
                            log=writer.log)
        per_step = {n: (runs[n][0].comm.calls - c) / ((args.rounds + 1) * args.steps) for n, c in calls.items()}
        k = 8 if args.optimizer == "adam" else 4
        rows, rates = [], results.summary("plain")
        for name, (strategy, model, optimizer, _) in runs.items():
            held = torch.tensor(list(held_bytes(strategy, model, optimizer).values()), dtype=torch.float64)
            peak = torch.zeros(1, dtype=torch.float64)
            if env.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(env.device)
                contender(name)()
                peak[0] = torch.cuda.max_memory_allocated(env.device)
            if env.distributed:  # shards differ by padding: report the largest rank
                held = held.to(env.device)
                gathered = [torch.zeros_like(held) for _ in range(env.world_size)]
                kdist.all_gather(gathered, held)
                held = torch.stack(gathered).max(0).values.cpu()
            formula = formula_bytes(name, psi, env.world_size, k)
            measured, predicted = held.sum().item(), sum(formula.values())
            rows.append({"kind": "bench-memory", "contender": name, "ranks": env.world_size,
                         "samples_per_sec": rates[name]["median_samples_per_sec"], "vs_plain": rates[name]["ratio"],
                         "collectives_per_step": per_step.get(name), "buckets": len(strategy.layout())
                         if strategy.name == "zero" else None,
                         "params_mb": held[0].item() / 1e6, "grads_mb": held[1].item() / 1e6,
                         "optimizer_mb": held[2].item() / 1e6, "state_mb": measured / 1e6,
                         "formula_mb": predicted / 1e6, "measured_over_formula": measured / predicted,
                         "peak_mb": peak.item() / 1e6 if env.device.type == "cuda" else None})
        print0(f"labkit bench zero | {args.model} (Ψ = {psi:,} parameters) | {args.optimizer} (K = {k}) | "
               f"{env.world_size} ranks on {env.device} | batch {args.batch_size}/rank | buckets of {args.bucket_mb} MB")
        print0(f"{'plain':<13}{rates['plain']['median_samples_per_sec']:>11.1f}{1.0:>9.2f}  (PyTorch DDP, "
               f"textbook loop)")
        peak_column = f"{'peak MB':>10}" if rows[0]["peak_mb"] else ""
        print0(f"{'contender':<13}{'samples/s':>11}{'vs plain':>9}{'(min-max)':>13}{'coll/step':>10}"
               f"{'state MB':>10}{'formula MB':>12}{'meas/form':>10}{peak_column}")
        for r in rows:
            s = rates[r["contender"]]
            coll = "" if r["collectives_per_step"] is None else f"{r['collectives_per_step']:.0f}"
            print0(f"{r['contender']:<13}{r['samples_per_sec']:>11.1f}{s['ratio']:>9.2f}"
                   f"{'(' + format(s['ratio_min'], '.2f') + '-' + format(s['ratio_max'], '.2f') + ')':>13}{coll:>10}"
                   f"{r['state_mb']:>10.3f}{r['formula_mb']:>12.3f}{r['measured_over_formula']:>10.3f}"
                   + (f"{r['peak_mb']:>10.1f}" if r["peak_mb"] else ""))
            writer.log(r)
        bucket = min(psi, int(args.bucket_mb * 1e6) // 4)  # float32 numbers in ZeRO's first bucket
        costs = collective_costs(bucket, env.device)
        print0(f"one bucket ({4 * bucket / 1e6:.3f} MB) on {dist.get_backend()}: all-reduce "
               f"{costs['all_reduce'] * 1e3:.2f} ms, reduce-scatter {costs['reduce_scatter'] * 1e3:.2f} ms, "
               f"all-gather {costs['all_gather'] * 1e3:.2f} ms: ZeRO's reduce-scatter + all-gather take "
               f"{(costs['reduce_scatter'] + costs['all_gather']) / costs['all_reduce']:.2f}x DDP's all-reduce")
        worst = max(abs(r["measured_over_formula"] - 1) for r in rows)
        met = {n: rates[n]["ratio"] >= t for n, t in SPEED_TARGETS.items()}
        print0(f"largest gap between measured state memory and the formula: {worst:.1%} (target <= {TARGET:.0%}); "
               "speed targets vs plain: " + ", ".join(f"{n} >= {t} {'met' if met[n] else 'NOT met'}"
                                                   for n, t in SPEED_TARGETS.items()))
        writer.finish(f"bench-zero-{env.world_size}", "bench", config_of(args),
                      {"contenders": rows, "timing": rates, "largest_formula_gap": worst, "parameters": psi,
                       "speed_targets_met": met, "collective_seconds": costs}, env)
    return 0

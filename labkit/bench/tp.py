"""labkit's Megatron tensor parallelism vs PyTorch's ``parallelize_module`` on the same GPT, tensors and steps.

    labkit bench tp                                   # 2 gloo ranks, gpt-tiny, with and without SP
    labkit bench tp --device cuda --ranks 2 --model gpt-small --batch-size 16 --block-size 256

One ``torchrun`` job of ``--ranks`` ranks (one tp group); inside it every rank alternates the contenders
round by round (:mod:`labkit.bench.harness`), each call ``--steps`` optimizer steps (SGD) over the same
preloaded random token batches:

- ``labkit``: the ``tp`` dimension of ``--mesh tp=N`` (:class:`labkit.parallel.mesh.MeshStrategy`): its
  ``forward_backward`` (vocabulary-parallel cross-entropy), ``sync_gradients``, the optimizer step: the step
  ``labkit.train.loop.train_step`` runs, without its metric sums;
- ``torch``: the same GPT sharded by ``parallelize_module`` (:mod:`labkit.parallel.megatron_dtensor`),
  ``F.cross_entropy`` under ``loss_parallel``, the same optimizer step;
- ``labkit-sp`` / ``torch-sp``: the same with sequence parallelism.

Samples/s counts the job's sequences (the ranks of a tp group share a batch). The ratios labkit/torch and
labkit-sp/torch-sp are medians of back-to-back pairs (``ratio``, ``sp_ratio`` in ``summary.json``; each
contender's own ``ratio`` there is to ``torch``). Target: >= 1.0.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

TARGET = 1.0

#: ``labkit bench tp`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--ranks", "type": "int", "range": "[2, 64]", "default": 2, "help": "tp ranks (one tp group)"},
    {"flag": "--model", "default": "gpt-tiny", "choices": ["gpt-tiny", "gpt-small", "gpt-100m"], "help": "GPT size"},
    {"flag": "--vocab-size", "type": "int", "range": "[2, inf)", "default": 96,
     "help": "tokens in the vocabulary (a multiple of --ranks)"},
    {"flag": "--block-size", "type": "int", "range": "[2, inf)", "default": 64,
     "help": "tokens per sequence (a multiple of --ranks)"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 8, "help": "sequences per step"},
    {"flag": "--steps", "type": "int", "range": "[1, inf)", "default": 5,
     "help": "optimizer steps per contender per round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 6, "help": "timed rounds"},
    {"flag": "--threads", "type": "int", "range": "[1, inf)", "default": 1, "help": "CPU threads per rank"},
    {"flag": "--device", "default": "cpu", "help": "cpu (gloo) or cuda (NCCL, one rank per GPU)"},
    {"flag": "--out", "default": "runs/bench-tp", "help": "results folder"},
    {"flag": "--worker", "action": "store_true", "hidden": True, "help": "one rank of the comparison"},
]


def main(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from labkit.errors import ConfigError
    from labkit.launch.local import torchrun
    from labkit.models.gpt import GPT_SIZES

    heads = GPT_SIZES[args.model].n_head
    checks = (("--vocab-size", args.vocab_size), ("--block-size", args.block_size), (f"{args.model}'s heads", heads))
    for what, n in checks:
        if n % args.ranks:
            raise ConfigError(f"{what} ({n}) must be a multiple of --ranks {args.ranks}")
    argv = ["bench", "tp", "--worker"] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                          if k not in ("func", "bench", "command", "worker", "ranks")]
    run = torchrun(argv, nproc=args.ranks, env={"OMP_NUM_THREADS": str(args.threads)},
                   echo=lambda line: print("   ", line, flush=True) if "error" in line.lower() else None)
    m = run.summary["metrics"]
    for name in ("labkit", "torch", "labkit-sp", "torch-sp"):
        print(f"{name:<10} {m[name]['median_samples_per_sec']:>9.1f} sequences/s "
              f"({m[name]['min_samples_per_sec']:.1f}-{m[name]['max_samples_per_sec']:.1f})")
    print(f"labkit/torch = {m['ratio']:.3f}, labkit-sp/torch-sp = {m['sp_ratio']:.3f} (median of {args.rounds} "
          f"paired rounds; target >= {TARGET}); results in {Path(args.out) / 'summary.json'}")
    return 0


def _worker(args: argparse.Namespace) -> int:
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.bench.harness import alternate, config_of
    from labkit.dist.group import distributed, print0
    from labkit.models.gpt import GPT, GPT_SIZES
    from labkit.parallel.megatron_dtensor import parallelize_gpt_dtensor
    from labkit.parallel.mesh import MeshStrategy
    from labkit.results import RunWriter

    with distributed(args.device) as env:
        torch.set_num_threads(args.threads)
        cfg = GPT_SIZES[args.model].replace(vocab_size=args.vocab_size, block_size=args.block_size)
        g = torch.Generator().manual_seed(0)
        shape = (args.steps, args.batch_size, args.block_size)
        xs = torch.randint(0, cfg.vocab_size, shape, generator=g).to(env.device)
        ys = torch.randint(0, cfg.vocab_size, shape, generator=g).to(env.device)

        def fresh() -> GPT:
            torch.manual_seed(0)
            return GPT(cfg).to(env.device)

        def labkit_steps(sp: bool):
            strategy = MeshStrategy(env, {"mesh": f"tp={env.world_size}", "sequence_parallel": sp})
            model = strategy.prepare(fresh())
            opt, criterion = torch.optim.SGD(model.parameters(), lr=1e-3), nn.CrossEntropyLoss()

            def run() -> int:
                for x, y in zip(xs, ys):
                    opt.zero_grad(set_to_none=True)
                    strategy.forward_backward(model, x, y, criterion)
                    strategy.sync_gradients(model)
                    opt.step()
                return args.steps * args.batch_size
            return run

        mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("tp",))

        def torch_steps(sp: bool):
            model = parallelize_gpt_dtensor(fresh(), mesh, sequence_parallel=sp)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def run() -> int:
                for x, y in zip(xs, ys):
                    opt.zero_grad(set_to_none=True)
                    with loss_parallel():
                        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                    opt.step()
                return args.steps * args.batch_size
            return run

        contenders = {"labkit": labkit_steps(False), "torch": torch_steps(False),
                      "labkit-sp": labkit_steps(True), "torch-sp": torch_steps(True)}
        writer = RunWriter(args.out, enabled=env.is_main)
        results = alternate(contenders, args.rounds, [env.device], log=writer.log)
        print0(results.table("torch", TARGET))
        sp_ratios = results.ratios("labkit-sp", "torch-sp")
        summary = results.summary("torch")
        metrics = {**summary, "ratio": summary["labkit"]["ratio"],
                   "sp_ratio": statistics.median(sp_ratios), "sp_ratio_min": min(sp_ratios),
                   "sp_ratio_max": max(sp_ratios),
                   "ranks": env.world_size}
        print0(f"labkit-sp/torch-sp = {metrics['sp_ratio']:.3f}")
        writer.finish("bench-tp", "bench", config_of(args), metrics, env)
    return 0

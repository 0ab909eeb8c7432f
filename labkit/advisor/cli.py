"""``labkit advise``: rank the parallel strategies for a model on this machine, optionally run the best.

    labkit advise --model alexnet_small --dataset synthetic-cifar10 --ranks 2
    labkit advise --model lenet --ranks 2 --validate --repeats 3
    labkit advise --model resnet20 --dataset synthetic-cifar10 --ranks 2 --memory-limit 0.5
    labkit advise --model gpt-1.3b --topology h100-nvlink --ranks 8 --seq-len 4096   # the mesh search
    labkit advise --model resnet20 --dataset synthetic-cifar10 --topology a100-pcie --ranks 8   # dp×pp meshes"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from labkit.errors import ConfigError
from labkit.ranges import within


def add_parser(sub) -> None:
    p = sub.add_parser("advise", help="predict, rank and validate parallel strategies for a model",
                       description=__doc__)
    p.add_argument("--model", required=True,
                   help="mlp, lenet, resnet20, resnet32, resnet50, alexnet_small; gpt-1.3b, gpt-tiny, ... (mesh search)")
    p.add_argument("--dataset", default="mnist-sample",
                   help="mnist, cifar10, mnist-sample, synthetic-mnist, synthetic-cifar10")
    p.add_argument("--ranks", type=within("int", "[1, inf)"), required=True, help="devices (this machine's gloo ranks)")
    p.add_argument("--batch-size", type=within("int", "[1, inf)"), default=64, help="global batch per optimizer step")
    p.add_argument("--memory-limit", type=within("float", "(0, inf)"), metavar="GB", help="usable memory per device")
    p.add_argument("--base-lr", type=within("float", "(0, inf)"),
                   help="learning rate for the printed commands and validation runs (default: labkit train's)")
    p.add_argument("--repeats", type=within("int", "[3, inf)"), default=3,
                   help="runs of each plan with --validate (the median and spread)")
    p.add_argument("--validate", action="store_true", help="run each plan through labkit train and compare the ranking")
    p.add_argument("--steps", type=within("int", "[4, inf)"), default=8, help="training steps per validation run")
    p.add_argument("--topology", default="local", choices=["local", "h100-nvlink", "a100-pcie", "h100-2x-ib"],
                   help="this machine's gloo ranks, or a GPU node from public specs (the mesh search)")
    p.add_argument("--seq-len", type=within("int", "[2, inf)"), help="a GPT's sequence length (default its block size)")
    p.add_argument("--cache", default="runs/advisor", help="where profiles and link fits are cached")
    p.add_argument("--refresh", action="store_true", help="profile again even if a cached profile matches")
    p.add_argument("--out", help="results folder (default runs/advise-<model>-<ranks>)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from labkit.advisor.advise import advise, flexflow_comparison, table
    from labkit.advisor.validate import validate
    from labkit.results import RunWriter

    if args.model.startswith("gpt") or args.topology != "local":
        return _mesh(args)
    out = Path(args.out or f"runs/advise-{args.model}-{args.ranks}")
    advice = advise(args.model, args.dataset, args.ranks, args.batch_size, args.memory_limit,
                    cache=args.cache, refresh=args.refresh)
    if args.base_lr is not None:
        advice.train_args = ("--base-lr", f"{args.base_lr:g}")
    print(f"labkit advise | {args.model} on {args.dataset} | {advice.topology.name} | global batch {args.batch_size}")
    if args.validate:
        validate(advice, args.repeats, args.steps, out)
    print(table(advice))
    if args.model.startswith("alexnet") and args.ranks == 2:
        print("\n" + flexflow_comparison(advice))
    path = advice.write(out / "advice.json")
    writer = RunWriter(out, append=True)
    for row in advice.to_dict()["plans"]:
        writer.log({"kind": "plan", **row})
    writer.finish(f"advise {args.model}", "advice", vars(args) | {"func": None},
                  {"best": advice.best.plan.label, "best_samples_per_sec": advice.best.samples_per_s})
    print(f"advice written to {path}")
    return 0


def _mesh(args: argparse.Namespace) -> int:
    """The mesh search on a named topology for a GPT's shape or a CNN's profile measured here at all the cores."""
    from labkit.advisor.measure import load_or_measure
    from labkit.advisor.search import explain, frontier, mesh_candidates, ms, size
    from labkit.advisor.topology import named
    from labkit.parallel.pricing import gpt_shape

    if args.topology == "local":
        raise ConfigError("the mesh search prices a GPU topology: give --topology h100-nvlink, a100-pcie or h100-2x-ib")
    topo = named(args.topology).with_memory(args.memory_limit)
    if args.ranks > topo.ranks:
        raise ConfigError(f"--ranks {args.ranks}: {topo.name} has {topo.ranks} GPUs")
    model = (gpt_shape(args.model, args.seq_len) if args.model.startswith("gpt") else
             load_or_measure(args.model, args.dataset, args.batch_size, os.cpu_count() or 1, args.cache, args.refresh))
    found = mesh_candidates(model, topo, args.batch_size, args.ranks)
    if not found:
        raise ConfigError(f"no mesh of {args.ranks} GPUs divides a batch of {args.batch_size}")
    print(explain(found, model, topo))
    print(f"{len(found)} plans, {sum(e.feasible for e in found)} fit; the frontier of memory vs time:")
    for e in frontier(found):
        print(f"  {e.plan.label:34s} {ms(e.step_s):>10s}/step {size(e.peak_bytes):>9s} per GPU")
    return 0

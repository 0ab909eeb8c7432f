"""``labkit allreduce verify|animate|bench``: check, watch and time the all-reduce algorithms.

    labkit allreduce verify --ranks 4 --algo all
    labkit allreduce animate --algo ring --ranks 4 --out ring.html        # or ring.gif
    labkit allreduce bench --algo all --ranks 2,4 --sizes 1KiB,64KiB,1MiB,16MiB
    torchrun --nproc-per-node 4 -m labkit allreduce bench --algo all     # inside a launched job (NCCL on GPUs)
    labkit allreduce bench --verify ...    # verify's check first, on the same ranks; nothing timed after a mismatch

``verify`` and ``bench`` spawn gloo ranks on this machine, unless the command already runs under
torchrun (RANK and WORLD_SIZE set): then they use that job's ranks and devices.
"""
from __future__ import annotations

import argparse
import os
import time

from labkit.collectives.registry import ALGORITHMS, SCHEDULES, parse_algorithms
from labkit.errors import ConfigError
from labkit.ranges import within

#: most processes ``--ranks`` may start on this machine
MAX_RANKS = 64


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ranks = []
    if not ranks or any(not 2 <= r <= MAX_RANKS for r in ranks):  # processes on this machine
        raise ConfigError(f"--ranks {text!r}: give world sizes >= 2 and <= {MAX_RANKS}, e.g. --ranks 4 or --ranks 2,4")
    return ranks


def _launched() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _in_job(fn, device: str, *args):
    from labkit.dist.group import distributed

    with distributed(device=device) as env:
        if env.world_size < 2:
            raise ConfigError("the launched job has one rank; start at least 2 (torchrun --nproc-per-node 2)")
        return env, fn(env, *args)


def verify(args: argparse.Namespace) -> int:
    from labkit.collectives.verify import format_verify, summarize, verify_rank

    algorithms = parse_algorithms(args.algo)
    if _launched():
        env, rows = _in_job(verify_rank, args.device, algorithms)
        results = [(env.world_size, rows)] if env.is_main else []
    else:
        from labkit.dist.testing import run_ranks

        results = [(p, run_ranks(verify_rank, p, algorithms, timeout=args.timeout)[0]) for p in _ranks(args.ranks)]
    ok = True
    for p, rows in results:
        print(format_verify(rows, p), flush=True)
        ok &= all(good for good, _ in summarize(rows).values())
    return 0 if ok else 1


def animate(args: argparse.Namespace) -> int:
    from labkit.collectives.registry import get_schedule
    from labkit.viz.allreduce import save_animation

    if args.algo not in SCHEDULES:
        raise ConfigError(f"unknown algorithm {args.algo!r} for --algo; choose from {', '.join(SCHEDULES)}")
    schedule = get_schedule(args.algo, _ranks(str(args.ranks))[0])
    start = time.perf_counter()
    path = save_animation(schedule, args.out, interval_ms=args.interval)
    print(f"wrote {path} ({schedule.num_steps} steps, {time.perf_counter() - start:.1f} s)")
    return 0


def _verify_and_bench(env, algorithms: list[str], sizes: list[int], repeats: int, dtype: str):
    """``verify``'s check, then (when every algorithm matched) ``bench_rank`` on the same ranks: (rows, out or
    None). The rows are the same on every rank, so all ranks skip the timing together."""
    from labkit.collectives.bench import bench_rank
    from labkit.collectives.verify import summarize, verify_rank

    rows = verify_rank(env, algorithms)
    ok = all(good for good, _ in summarize(rows).values())
    return rows, (bench_rank(env, algorithms, sizes, repeats, dtype) if ok else None)


def bench(args: argparse.Namespace) -> int:
    from labkit.collectives.bench import bench_rank, format_size, format_table, parse_size
    from labkit.collectives.verify import format_verify
    from labkit.results import RunWriter

    algorithms = parse_algorithms(args.algo)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    config = {"algorithms": algorithms, "sizes": sizes, "repeats": args.repeats, "dtype": args.dtype}
    rank_fn = _verify_and_bench if args.verify else bench_rank
    if _launched():
        env, out = _in_job(rank_fn, args.device, algorithms, sizes, args.repeats, args.dtype)
        outs, main = ([(env.world_size, out)] if env.is_main else []), env.is_main
    else:
        from labkit.dist.testing import run_ranks

        env, main = None, True
        outs = [(p, run_ranks(rank_fn, p, algorithms, sizes, args.repeats, args.dtype, timeout=args.timeout)[0])
                for p in _ranks(args.ranks)]
    if not main:
        return 0
    if args.verify:
        for p, (rows, _) in outs:
            print(format_verify(rows, p), flush=True)
        if any(out is None for _, (_, out) in outs):
            return 1  # a mismatch: nothing was timed
        outs = [(p, out) for p, (_, out) in outs]
    writer = RunWriter(args.out)
    records, metrics = [], {}
    for p, out in outs:
        writer.log({"kind": "cost-model", "world_size": p, **out["model"], "p2p": out["p2p"]})
        if out["trace"]:
            writer.log(out["trace"])
        for record in out["records"]:
            writer.log(record)
            records.append(record)
            if record["algorithm"] == "ring":
                metrics[f"ring_vs_native_p{p}_{record['bytes']}B"] = record["vs_native"]
    print(format_table(records))
    for p, out in outs:
        size = max(r["bytes"] for r in out["records"])
        largest = [r for r in out["records"] if r["bytes"] == size]
        native = next(r for r in largest if r["algorithm"] == "native")
        best = max((r for r in largest if r["algorithm"] != "native"), key=lambda r: r["busbw_GBps"], default=None)
        line = f"p={p}, {format_size(size)}: native busbw {native['busbw_GBps']:.3f} GB/s"
        if best is not None:
            line += f", best labkit schedule {best['algorithm']} {best['busbw_GBps']:.3f} GB/s"
        print(line)
        m = out["model"]
        print(f"p={p}: fitted alpha {m['alpha'] * 1e6:.1f} us, beta {1 / max(m['beta'], 1e-30) / 1e9:.2f} GB/s, "
              f"gamma {1 / max(m['gamma'], 1e-30) / 1e9:.2f} GB/s (adds)")
    writer.finish("allreduce-bench", "bench", config, metrics, env=env,
                  world_sizes=[p for p, _ in outs])
    print(f"results in {args.out}")
    return 0


def add_parser(subparsers) -> None:
    """Add ``labkit allreduce`` and its three actions."""
    p = subparsers.add_parser("allreduce", help="verify, animate and benchmark the all-reduce algorithms",
                              description=__doc__)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="auto", help="under torchrun: auto, cpu or cuda (default auto)")
    common.add_argument("--timeout", type=within("float", "(0, 1e7]"),
                        default=600.0, help="seconds before spawned ranks are stopped")

    v = actions.add_parser("verify", parents=[common], help="compare every algorithm with dist.all_reduce")
    v.add_argument("--ranks", default="4", help="world size(s) to spawn, e.g. 4 or 2,3,4,5 (default 4)")
    v.add_argument("--algo", default="all", help=f"all or a comma list of: {', '.join(ALGORITHMS)}")
    v.set_defaults(func=verify)

    a = actions.add_parser("animate", help="write an animation of one schedule (.html or .gif)")
    a.add_argument("--algo", default="ring", help=f"one of: {', '.join(SCHEDULES)}")
    a.add_argument("--ranks", type=within("int", "[2, 64]"), default=4, help="world size (default 4)")
    a.add_argument("--out", required=True, help="FILE.html (interactive player) or FILE.gif")
    a.add_argument("--interval", type=within("int", "[1, 600000]"),
                   default=1200, help="milliseconds per step (default 1200)")
    a.set_defaults(func=animate)

    b = actions.add_parser("bench", parents=[common], help="time every algorithm and native all-reduce")
    b.add_argument("--algo", default="all", help=f"all or a comma list of: {', '.join(ALGORITHMS)}")
    b.add_argument("--ranks", default="2,4", help="world sizes to spawn (default 2,4)")
    b.add_argument("--sizes", default="1KiB,64KiB,1MiB,16MiB", help="vector sizes (default 1KiB,64KiB,1MiB,16MiB)")
    b.add_argument("--repeats", type=within("int", "[1, inf)"),
                   default=5, help="timed runs per contender and size (default 5)")
    b.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    b.add_argument("--out", default="runs/allreduce-bench", help="results directory (labkit run schema)")
    b.add_argument("--verify", action="store_true",
                   help="first check every algorithm against dist.all_reduce (as verify does) on the same ranks; "
                        "a mismatch ends with exit 1 and nothing timed")
    b.set_defaults(func=bench)
    p.set_defaults(func=lambda args: _no_action(p))


def _no_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2

"""The pipeline schedules (labkit.parallel.pp_schedule), counted and run: idle time in the simulator against each
generator's formula, then the same 4-stage GPT trained under each schedule, alternated, with its measured bubble.

    labkit bench pp-schedules                         # 4 gloo ranks, 8 micro-batches, 2 rounds
    labkit bench pp-schedules --rounds 3 --microbatches 8 --steps 4

1. Counted: for p = 2, 3, 4, 8 and m = 2p, 3p, 4p, every schedule is simulated at ``t_F = t_B = t_W = 1`` and at
   ``(2, 2, 1)`` (``(2, 2, 2)`` for ZBV and DualPipeV, whose formula holds at equal costs); each rank's idle time must
   equal the formula of its generator's docstring, exactly (fractions). A mismatch fails the benchmark (exit 1).
2. Run: :func:`labkit.lab.pipeline_schedules.measure_schedules` on ``--ranks`` forked gloo ranks, every schedule
   once per round, the order reversed every other round (alternated: a slow moment of the machine falls on
   different schedules). Per schedule the median measured bubble (``1 − busy/span``, waits count as idle) beside
   the simulated one, and the measured peak activations. On a 2-core laptop the 4 ranks share the cores, so the
   measured bubbles mix the schedule with time-sharing: the ordering GPipe ≥ 1F1B ≥ interleaved ≥ ZB-H1 is reported,
   not required; the simulated ordering is.

Records of kind ``"bench"`` (one per schedule and round) and ``summary.json`` in ``--out``.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

#: ``labkit bench pp-schedules`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--ranks", "type": "int", "range": "[2, 16]", "default": 4, "help": "pipeline ranks (pp)"},
    {"flag": "--microbatches", "type": "int", "range": "[1, inf)", "default": 8,
     "help": "micro-batches per step (>= 2 × --ranks for DualPipeV)"},
    {"flag": "--steps", "type": "int", "range": "[2, inf)", "default": 3, "help": "steps per schedule and round"},
    {"flag": "--rounds", "type": "int", "range": "[1, inf)", "default": 2, "help": "rounds over every schedule"},
    {"flag": "--out", "default": "runs/bench-pp-schedules", "help": "results folder"},
]

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1, "zbv": 2, "dualpipev": 2}


def formula(name: str, p: int, v: int, t_f, t_b, t_w):
    """Idle time per rank, as each generator's docstring writes it."""
    return {"gpipe": (p - 1) * (t_f + t_b + t_w), "1f1b": (p - 1) * (t_f + t_b + t_w),
            "interleaved-1f1b": (p - 1) * (t_f + t_b + t_w) / v, "zb-h1": (p - 1) * (t_f + t_b - t_w),
            "zbv": (p - 1) * t_f / 2, "dualpipev": (p - 1) * t_f / 2}[name]


def counted() -> list[dict]:
    """Every schedule, size and cost: the simulator's idle time beside the formula."""
    from fractions import Fraction

    from labkit.parallel.pp_schedule import pipe_schedule
    from labkit.parallel.pp_simulate import simulate

    rows = []
    for name, v in SCHEDULES.items():
        for p in (2, 3, 4, 8):
            for m in (2 * p, 3 * p, 4 * p):
                costs = [(1, 1, 1), (2, 2, 2) if name in ("zbv", "dualpipev") else (2, 2, 1)]
                for t in costs:
                    idle = simulate(pipe_schedule(name, p, m, v), *t).idle
                    want = Fraction(formula(name, p, v, *t))
                    rows.append({"schedule": name, "p": p, "m": m, "v": v, "costs": t, "idle": [str(x) for x in idle],
                                 "formula": str(want), "equal": all(x == want for x in idle)})
    return rows


def main(args: argparse.Namespace) -> int:
    from labkit.errors import ConfigError
    from labkit.lab.pipeline_schedules import measure_schedules
    from labkit.results import RunWriter
    from labkit.viz.pipeline import bubble_fraction, peak_memory, theoretical_bubble

    if args.microbatches < 2 * args.ranks or args.microbatches % args.ranks:
        raise ConfigError(f"--microbatches {args.microbatches}: every schedule needs a multiple of --ranks "
                          f"{args.ranks} of at least {2 * args.ranks} (DualPipeV's minimum)")
    writer = RunWriter(args.out)
    rows = counted()
    bad = [r for r in rows if not r["equal"]]
    print(f"counted: {len(rows) - len(bad)} of {len(rows)} (schedule, p, m, costs) idle times equal their formula")
    for r in bad:
        print(f"  MISMATCH {r['schedule']} p={r['p']} m={r['m']} costs {r['costs']}: idle {r['idle']}, formula "
              f"{r['formula']}")
    measured: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    peaks: dict[str, dict] = {}
    for rnd in range(args.rounds):
        order = list(SCHEDULES) if rnd % 2 == 0 else list(reversed(SCHEDULES))
        runs = measure_schedules({n: {"pp_schedule": n, "pp_virtual": SCHEDULES[n]} for n in order},
                                 ranks=args.ranks, steps=args.steps, trace_steps=args.steps - 1, batch=2 * args.microbatches,
                                 microbatches=args.microbatches)
        for name, run in runs.items():
            bubble = bubble_fraction(run["trace"])
            measured[name].append(bubble["measured"])
            peaks[name] = peak_memory(run["trace"])
            writer.log({"kind": "bench", "contender": name, "round": rnd, "measured_bubble": bubble["measured"],
                        "simulated_bubble": bubble["theoretical"], "span_s": bubble["span_s"],
                        "peak_mb": peaks[name]})
    summary = {}
    print(f"{'schedule':17} {'measured bubble':>16} {'simulated':>10}  peak activations MB per rank")
    for name, v in SCHEDULES.items():
        sim = theoretical_bubble(args.ranks, args.microbatches, name, v)
        med = statistics.median(measured[name])
        summary[name] = {"median_measured_bubble": med, "simulated_bubble": sim, "peak_mb": peaks[name]}
        print(f"{name:17} {med:16.1%} {sim:10.1%}  {[round(x, 3) for x in peaks[name].values()]}")
    chain = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
    holds = all(summary[a]["median_measured_bubble"] >= summary[b]["median_measured_bubble"]
                for a, b in zip(chain, chain[1:]))
    simulated = all(summary[a]["simulated_bubble"] >= summary[b]["simulated_bubble"] for a, b in zip(chain, chain[1:]))
    print(f"measured ordering GPipe >= 1F1B >= interleaved >= ZB-H1: {'holds' if holds else 'does not hold'} "
          f"(simulated: {'holds' if simulated else 'DOES NOT HOLD'}); results in {Path(args.out) / 'summary.json'}")
    writer.finish("bench-pp-schedules", "bench", {k: v for k, v in vars(args).items() if k not in ("func",)},
                  {"schedules": summary, "counted_equal": len(rows) - len(bad), "counted": len(rows),
                   "measured_ordering_holds": holds, "simulated_ordering_holds": simulated})
    return 0 if not bad and simulated else 1

"""How well does the advisor rank? For each model every plan of its table is run for real on this machine,
``--repeats`` times round-robin (``labkit advise --validate``'s :func:`labkit.advisor.validate.validate`), and the
ranking is judged: Spearman's rho between predicted and measured steps, and the measured step of the predicted
best over the measured best.

    python benchmarks/advisor_accuracy.py --refresh              # lenet, alexnet_small, resnet20 on 2 ranks
    python benchmarks/advisor_accuracy.py --models lenet --repeats 3
    python benchmarks/advisor_accuracy.py --models resnet20 --steps 3 --one-thread   # a busy machine

Targets (issue 33): rho >= 0.8 on each model, the predicted best within 10 % of the measured best. The link is
measured afresh for each model; the profiles come from the cache unless ``--refresh``. Results are written as
they come: ``<out>/<model>.runs.jsonl`` after each run (with the plan's predicted terms, to see which one is
off), ``<out>/<model>/advice.json`` after each model and ``<out>/summary.json`` (one key per model done), with
the command, the load average before and after (the machine may be shared) and the measured prices every plan
pays (κ, α, and α-β per kind of collective); the training runs themselves go to ``--runs``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from labkit.advisor.advise import advise, table
from labkit.advisor.measure import local_topology
from labkit.advisor.validate import ranking, validate
from labkit.data import datasets as kdata
from labkit.ranges import within

DATASETS = {"lenet": "mnist-sample", "alexnet_small": "synthetic-cifar10", "resnet20": "synthetic-cifar10"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DATASETS))
    parser.add_argument("--ranks", type=within("int", "[1, inf)"), default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="steps per run at least (the first is not timed)")
    parser.add_argument("--min-run-s", type=float, default=1.0,
                        help="more steps for a fast model: a run of the predicted best lasts this long "
                             "(within an epoch)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per plan (median and spread)")
    parser.add_argument("--refresh", action="store_true", help="profile again")
    parser.add_argument("--one-thread", action="store_true",
                        help="profile at one thread per process only, as notebook 08's quick mode (a one-process "
                             "plan is then priced, and run, on one thread; a 2-thread profile is the slowest to "
                             "time on a busy machine)")
    parser.add_argument("--out", default="runs/advisor-accuracy", help="the results (e.g. results/advisor-accuracy)")
    parser.add_argument("--runs", default="runs/advisor-accuracy-runs", help="the validation runs' own folders")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    for model in args.models:
        start, load = time.perf_counter(), os.getloadavg()[0]
        topo = local_topology(args.ranks, refresh=True)
        advice = advise(model, DATASETS.get(model, "synthetic-cifar10"), args.ranks, args.batch_size,
                        refresh=args.refresh, topology=topo,
                        profile_topology=replace(topo, cores=1) if args.one_thread else None)
        # the learning rate changes no timing; AlexNet without BatchNorm needs a small one not to diverge
        advice.train_args = ("--base-lr", "0.005")
        log = (out / model).with_suffix(".runs.jsonl")

        def record(label: str, metrics: dict, model=model, advice=advice, log=log) -> None:
            with log.open("a") as f:  # each run as it comes: a benchmark cut short keeps what it measured
                est = advice.find(label)
                f.write(json.dumps({"model": model, "plan": label, "predicted_s": est.step_s,
                                    "measured_s": advice.batch_size / metrics["samples_per_sec"],
                                    "terms": est.time, "load": os.getloadavg()[0]}) + "\n")

        # a run of a fast model lasts at least --min-run-s (LeNet's 12 steps take a tenth of a second: all noise),
        # at most one epoch (the loop's samples/s is its last epoch's)
        epoch = len(kdata.get_dataset(advice.dataset, train=True)) // args.batch_size
        steps = max(args.steps, min(epoch, math.ceil(args.min_run_s / advice.best.step_s)))
        validate(advice, args.repeats, steps, Path(args.runs) / model, progress=False, record=record)
        advice.write(out / model / "advice.json")
        r = ranking(advice)
        shared = advice.profiles[args.ranks]  # the profile the plans of several processes use
        summary[model] = {**r, "predicted_best": advice.best.plan.label, "seconds": time.perf_counter() - start,
                          "steps": steps,
                          "command": " ".join(["python", *sys.argv]), "kappa": shared.concurrency,
                          "alpha_s": topo.link.alpha, "links": {k: {"alpha": v.alpha, "beta": v.beta}
                                                                for k, v in topo.kinds.items()},
                          "load_before": load, "load_after": os.getloadavg()[0],
                          "failed": [e.plan.label for e in advice.table if "error" in advice.measured.get(
                              e.plan.label, {})]}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"== {model}: rho {r['spearman']:.2f}, predicted best {r['best_ratio']:.2f}x the measured best "
              f"({r['plans']} plans, {summary[model]['seconds']:.0f} s, load {load:.1f} -> "
              f"{summary[model]['load_after']:.1f} on {os.cpu_count()} cores)")
        print(table(advice), flush=True)


if __name__ == "__main__":
    main()

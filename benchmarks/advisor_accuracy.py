"""How well does the advisor predict? For each model, every plan in its table is run for real on this machine
and the predicted step time is set beside the measured one.

    python benchmarks/advisor_accuracy.py                        # lenet, alexnet_small, resnet20 on 2 ranks
    python benchmarks/advisor_accuracy.py --models lenet --ranks 2 --steps 10 --refresh

Targets: every plan within 25 % (measured / predicted in 0.75 .. 1.25), and the predicted best is the
measured best or within 10 % of it. Results: ``runs/advisor-accuracy/<model>/advice.json`` and one summary.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from labkit.advisor.advise import advise
from labkit.advisor.report import table
from labkit.advisor.validate import validate

DATASETS = {"lenet": "mnist-sample", "alexnet_small": "synthetic-cifar10", "resnet20": "synthetic-cifar10"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DATASETS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--refresh", action="store_true", help="profile again (do it when the machine's load changed)")
    parser.add_argument("--out", default="runs/advisor-accuracy")
    args = parser.parse_args()
    summary = {}
    for model in args.models:
        advice = advise(model, DATASETS.get(model, "synthetic-cifar10"), args.ranks, args.batch_size,
                        refresh=args.refresh)
        out = Path(args.out) / model
        # the learning rate changes no timing; AlexNet without BatchNorm needs a small one not to diverge
        validate(advice, top=len(advice.table), steps=args.steps, out=out, progress=False, extra=("--base-lr", "0.005"))
        advice.write(out / "advice.json")
        print(f"== {model}\n{table(advice)}\n")
        rows = [(e.plan.label, e.step_s, advice.measured[e.plan.label]["step_s"]) for e in advice.table
                if "step_s" in advice.measured.get(e.plan.label, {})]
        within = sum(0.75 <= m / p <= 1.25 for _, p, m in rows)
        fastest = min(m for _, _, m in rows)
        best_measured = advice.measured.get(advice.best.plan.label, {}).get("step_s", float("nan"))
        summary[model] = {"plans": len(rows), "within_25pct": within, "predicted_best": advice.best.plan.label,
                          "measured_best": min(rows, key=lambda r: r[2])[0],
                          "predicted_best_vs_measured_best": best_measured / fastest,
                          "rows": [{"plan": label, "predicted_s": p, "measured_s": m, "ratio": m / p}
                                   for label, p, m in rows]}
        print(f"{model}: {within}/{len(rows)} plans within 25 %; predicted best {advice.best.plan.label} is "
              f"{best_measured / fastest:.2f}× the measured best ({summary[model]['measured_best']})\n", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()

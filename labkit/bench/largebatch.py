"""Accuracy vs global batch: SGD (linear scaling + warm-up) vs LARS vs LAMB vs K-FAC on the same epochs.

    labkit bench largebatch                                 # mlp on mnist-sample, batch 16 x 1, 4, 16, 64
    labkit bench largebatch --scales 1 8 64 --epochs 4 --optimizers sgd lars

Every run trains the same model from the same weights through ``labkit train``'s loop for the same number
of epochs; only the global batch (base batch × scale) and the optimizer change. A larger batch means
fewer steps per epoch, which is where the optimizers differ. Learning rates follow each method's scaling
rule (base rate × scale for SGD and K-FAC, base rate × √scale for LAMB; LARS's trust ratio sets the
per-layer rate itself, from base rate × √scale), with a one-epoch linear warm-up whenever the batch is scaled up. One process: a
global batch is a batch, as data parallelism with that many ranks would see it (same gradient). Reports
test accuracy after each epoch, in the labkit results schema (records of kind "bench").
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from labkit.errors import ConfigError

#: optimizer -> (base learning rate at scale 1, exponent of the scale in the rate, extra optim options)
RECIPES = {"sgd": (0.01, 1.0, {}), "lars": (1.0, 0.5, {"lars_trust_coefficient": 0.001}),
           "lamb": (0.005, 0.5, {}),
           "kfac": (0.01, 1.0, {"kfac_update_freq": 5, "kfac_damping": 0.03, "kfac_base": "sgd"})}


#: ``labkit bench largebatch`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--model", "default": "mlp", "help": "labkit model"},
    {"flag": "--dataset", "default": "mnist-sample", "help": "dataset"},
    {"flag": "--optimizers", "nargs": "+", "default": ["sgd", "lars", "lamb", "kfac"],
     "choices": ["sgd", "lars", "lamb", "kfac"], "help": "optimizers to compare (see RECIPES)"},
    {"flag": "--scales", "nargs": "+", "type": "int", "default": [1, 4, 16, 64], "help": "global batch = batch × scale"},
    {"flag": "--batch-size", "type": "int", "default": 16, "help": "base batch at scale 1"},
    {"flag": "--epochs", "type": "int", "default": 3, "help": "epochs of every run"},
    {"flag": "--train-size", "type": "int", "default": None, "help": "first N training samples (default: all)"},
    {"flag": "--test-size", "type": "int", "default": 1000, "help": "test samples evaluated after each epoch"},
    {"flag": "--seed", "type": "int", "default": 0, "help": "seed of the weights and the data order"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": "runs/bench-largebatch", "help": "results folder"},
]


def learning_rate(optimizer: str, scale: int) -> float:
    base, exponent, _ = RECIPES[optimizer]
    return base * scale ** exponent


def sweep(out: str | Path, *, model: str = "mlp", dataset: str = "mnist-sample", optimizers=tuple(RECIPES),
          scales=(1, 4, 16, 64), batch_size: int = 16, epochs: int = 3, train_size: int | None = None,
          test_size: int | None = 1000, seed: int = 0, device: str = "auto") -> list[dict]:
    """Train every (scale, optimizer) once through :func:`labkit.train.run`; one row per run with the test
    accuracy after each epoch (``test_acc``), also logged to ``out/metrics.jsonl``."""
    from labkit.results import RunWriter, load_run
    from labkit.train import TrainConfig, run

    if any(s < 1 for s in scales) or batch_size < 1 or epochs < 1:
        raise ConfigError("--scales, --batch-size and --epochs must be >= 1")
    out = Path(out)
    writer = RunWriter(out)
    rows = []
    for scale in scales:
        for name in optimizers:
            if name not in RECIPES:
                raise ConfigError(f"unknown optimizer {name!r}; choose from {', '.join(RECIPES)}")
            cfg = TrainConfig(model=model, dataset=dataset, epochs=epochs, batch_size=batch_size * scale,
                              optimizer=name, base_lr=learning_rate(name, scale),
                              warmup_epochs=1.0 if scale > 1 else 0.0,
                              weight_decay=1e-4 if name in ("lars", "lamb") else 0.0, train_size=train_size,
                              test_size=test_size, seed=seed, device=device, out=str(out / f"{name}-x{scale}"),
                              checkpoint=False, log_every=10**6, optim_options=dict(RECIPES[name][2]))
            summary = run(cfg)
            accs = [r["test_acc"] for r in load_run(cfg.out).records_of("epoch")]
            row = {"kind": "bench", "optimizer": name, "scale": scale, "global_batch": cfg.batch_size,
                   "lr": cfg.base_lr, "test_acc": accs, "final_test_acc": accs[-1],
                   "time_s": summary["metrics"]["time_s"]}
            writer.log(row)
            rows.append(row)
    writer.finish("bench-largebatch", "bench", {"model": model, "dataset": dataset, "optimizers": list(optimizers),
                                                "scales": list(scales), "batch_size": batch_size, "epochs": epochs,
                                                "train_size": train_size, "test_size": test_size, "seed": seed},
                  {"final_test_acc": {f"{r['optimizer']}-x{r['scale']}": r["final_test_acc"] for r in rows}})
    return rows


def main(args: argparse.Namespace) -> int:
    rows = sweep(args.out, model=args.model, dataset=args.dataset, optimizers=args.optimizers, scales=args.scales,
                 batch_size=args.batch_size, epochs=args.epochs, train_size=args.train_size,
                 test_size=args.test_size, seed=args.seed, device=args.device)
    print(f"\n{'optimizer':>9} " + " ".join(f"{f'x{s} ({s * args.batch_size})':>12}" for s in args.scales))
    for name in args.optimizers:
        accs = {r["scale"]: r["final_test_acc"] for r in rows if r["optimizer"] == name}
        print(f"{name:>9} " + " ".join(f"{100 * accs[s]:>11.1f}%" for s in args.scales))
    print(f"test accuracy after {args.epochs} epochs; results in {args.out}/summary.json")
    return 0 if all(math.isfinite(r["final_test_acc"]) for r in rows) else 1

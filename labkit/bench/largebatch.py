"""Accuracy vs global batch: SGD (linear scaling + warm-up) vs LARS vs LAMB vs K-FAC on the same epochs.

    labkit bench largebatch                                 # mlp on mnist-sample, batch 16 x 1, 4, 16, 64
    labkit bench largebatch --scales 1 8 64 --epochs 4 --optimizers sgd lars

Every run trains the same model from the same weights through ``labkit train``'s loop for the same number
of epochs; only the global batch (base batch × scale) and the optimizer change. A larger batch means
fewer steps per epoch (4,000 digits: 250 steps at ×1, 4 at ×64), which is where the optimizers differ.
Every run scaled up warms its rate up linearly over the first epoch. One process: a global batch is a
batch, as data parallelism with that many ranks would see it (same gradient). Reports test accuracy after
each epoch, in the labkit results schema (records of kind "bench").

**The recipes** (:data:`RECIPES`, rate = base × scale^exponent) come from a sweep on this default setting (MLP,
4,000 digits, base batch 16, 3 epochs; test accuracy after epoch 3):

* SGD, linear scaling (exponent 1): base 0.01 gave 94.4 % at ×1 (0.03: 92.0 %, 0.1: diverged); ×16 at
  0.16 92.5 %; at ×64 every rate failed: 0.32 68.4 %, 0.64 16.3 %, 1.28 10 % (two-epoch warm-up: 67.5 % at
  0.16, 15.8 % at 0.32).
* LARS (trust coefficient η = 0.001, weight decay 1e-4): the trust ratio already sets each layer's step from
  ‖w‖, so the global rate needs little scaling: γ = 4 gave 89.4 % at ×1 (γ = 8: 76.7 %); γ = 8 89.5 % at
  ×16 (γ = 20: 86.8 %) and 87.6 % at ×64 (γ = 4: 84.7 %, 16: 84.5 %, 40: 41.3 %). η = 0.01 (γ = 8 to 16)
  or 0.02 was worse at ×16 and ×64 (≤ 55 %). Hence γ = 4 × scale^¼.
* LAMB (weight decay 0.01), √ scaling: base 0.003 gave 93.9 % at ×1 (0.001: 91.6 %), 90.3 % at ×16 and
  85.6 % at ×64 (0.01 × 8 = 0.08: 72.1 %).
* K-FAC on SGD (damping 0.03, KL clipping): 88.9 % at ×64 with factors every step, whether the rate was
  0.32 or 0.64 (the KL clip bounds the step). Updates every max(1, 16 / scale) steps: a large batch has few
  steps and better factor estimates.

The full run with these recipes (``labkit bench largebatch --device cpu``, test accuracy after 3 epochs):

    optimizer      x1 (16)      x4 (64)    x16 (256)   x64 (1024)
          sgd        94.5%        92.2%        90.1%        11.4%
         lars        80.7%        91.5%        91.2%        79.9%
         lamb        92.9%        92.2%        89.2%        85.9%
         kfac        90.9%        92.9%        91.7%        89.4%

So at these sizes linear scaling + warm-up is as good as anything at small batches (LARS caps small-batch
steps and is the noisiest at ×1); by ×16 LARS and K-FAC are ahead of it, and at ×64, 12 steps in all, it
diverges while LARS, LAMB and K-FAC keep 80-89 %: the large-batch effect of the literature, at the larger
batches only.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from labkit.errors import ConfigError

#: optimizer -> (base learning rate at scale 1, exponent of the scale in the rate, weight decay, optim options);
#: the sweep behind them is in the module docstring
RECIPES = {"sgd": (0.01, 1.0, 0.0, {}),
           "lars": (4.0, 0.25, 1e-4, {"lars_trust_coefficient": 0.001}),
           "lamb": (0.003, 0.5, 0.01, {}),
           "kfac": (0.01, 1.0, 0.0, {"kfac_damping": 0.03, "kfac_base": "sgd"})}
#: steps between K-FAC updates at scale 1; max(1, KFAC_INTERVAL // scale) at larger batches
KFAC_INTERVAL = 16


#: ``labkit bench largebatch`` flags, plain data read without importing this module (labkit.flags)
FLAGS = [
    {"flag": "--model", "default": "mlp", "help": "labkit model"},
    {"flag": "--dataset", "default": "mnist-sample", "help": "dataset"},
    {"flag": "--optimizers", "nargs": "+", "default": ["sgd", "lars", "lamb", "kfac"],
     "choices": ["sgd", "lars", "lamb", "kfac"], "help": "optimizers to compare (see RECIPES)"},
    {"flag": "--scales", "nargs": "+", "type": "int", "range": "[1, inf)", "default": [1, 4, 16, 64],
     "help": "global batch = batch × scale"},
    {"flag": "--batch-size", "type": "int", "range": "[1, inf)", "default": 16, "help": "base batch at scale 1"},
    {"flag": "--epochs", "type": "int", "range": "[1, inf)", "default": 3, "help": "epochs of every run"},
    {"flag": "--train-size", "type": "int", "range": "[1, inf)", "default": None,
     "help": "first N training samples (default: all)"},
    {"flag": "--test-size", "type": "int", "range": "[1, inf)", "default": 1000,
     "help": "test samples evaluated after each epoch"},
    {"flag": "--seed", "type": "int", "range": "[0, 4294967295]", "default": 0,
     "help": "seed of the weights and the data order"},
    {"flag": "--device", "default": "auto", "help": "auto, cpu or cuda"},
    {"flag": "--out", "default": "runs/bench-largebatch", "help": "results folder"},
]


def learning_rate(optimizer: str, scale: int) -> float:
    base, exponent, _, _ = RECIPES[optimizer]
    return base * scale ** exponent


def optim_options(optimizer: str, scale: int) -> dict:
    """The recipe's optimizer options at ``scale`` (K-FAC's update interval shrinks as the batch grows)."""
    options = dict(RECIPES[optimizer][3])
    if optimizer == "kfac":
        options["kfac_update_freq"] = max(1, KFAC_INTERVAL // scale)
    return options


def sweep(out: str | Path, *, model: str = "mlp", dataset: str = "mnist-sample", optimizers=tuple(RECIPES),
          scales=(1, 4, 16, 64), batch_size: int = 16, epochs: int = 3, train_size: int | None = None,
          test_size: int | None = 1000, seed: int = 0, device: str = "auto") -> list[dict]:
    """Train every (scale, optimizer) once through :func:`labkit.train.run.run`; one row per run with the test
    accuracy after each epoch (``test_acc``), also logged to ``out/metrics.jsonl``."""
    from labkit.results import RunWriter, load_run
    from labkit.train.config import TrainConfig
    from labkit.train.run import run

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
                              weight_decay=RECIPES[name][2], train_size=train_size,
                              test_size=test_size, seed=seed, device=device, out=str(out / f"{name}-x{scale}"),
                              checkpoint=False, log_every=10**6, optim_options=optim_options(name, scale))
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

"""``labkit tour``: a few CPU minutes that show the whole kit once.

1. where you are (torch, devices, cores);
2. a LeNet trained on 5,000 real MNIST digits through the one training loop, with the throughput and
   memory lines you will compare across strategies;
3. the results files and a plot of them;
4. ring all-reduce: a schedule checked in the simulator, then run for real on 2 gloo ranks and compared
   with ``dist.all_reduce``, and its animation written to HTML;
5. where to go next.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from labkit.ranges import within

NOTEBOOKS = """\
    00_single_device      PyTorch in 4 steps, throughput, memory and utilisation
    01_allreduce          seven all-reduce algorithms, animated and run for real
    01b_synchronisation   parameter server: sync, async and stale-synchronous, staleness measured
    02_data_parallel      DDP with torchrun, scaling, linear LR scaling + warm-up
    03_model_parallel     layer split, vertical FC slicing, the FlexFlow hybrid strategy
    04_pipeline           GPipe micro-batches, GPipe vs 1F1B bubbles
    04b_pipeline_schedules          interleaved, zero-bubble, ZBV, DualPipeV: as data, simulated, run
    05_kfac               K-FAC, the Kronecker-factored preconditioner
    05b_second_order_at_scale       SGD, Adam, K-FAC, Shampoo, SOAP and Muon on one harness, split over ranks
    06_cifar10_resnet32_multi_gpu   SGD vs K-FAC on N GPUs
    07_sharded_data_parallel        ZeRO stages 1-3 from scratch and FSDP2, memory per rank
    08_strategy_advisor   which strategy for this model on this machine: predicted vs measured
    09_transformer_parallelism      one GPT on a mesh: dp, tp, sequence parallel, dp x tp x pp
    10_long_context_and_experts     ring attention (cp) and a mixture of experts (ep): the KV ring, all-to-all
    11_when_it_breaks     ten broken programs: read the hang table, catch silent failures, fix them
    12_flops_and_memory   a GPT's peak memory predicted, then measured; recomputation; MFU here vs a GPU's"""


def next_steps(cwd: Path | None = None) -> list[tuple[str, str]]:
    """``(command, what it does)`` pairs that run as printed from ``cwd`` in the current shell.

    A command of this environment is named by its path unless the shell's ``PATH`` already finds it (the
    environment is not activated), and the checkout's folders by their path relative to ``cwd``.
    """
    cwd = Path.cwd() if cwd is None else cwd
    checkout = Path(__file__).resolve().parents[1]

    def exe(name: str) -> str:
        mine = Path(sys.executable).parent / name
        found = shutil.which(name)
        if found and Path(found).resolve() == mine.resolve():
            return name
        return _relative(mine, cwd) if mine.exists() else name

    listed = [line.split()[0][:2] for line in NOTEBOOKS.splitlines()]  # the list above, first to last
    steps = [(f"{exe('jupyter')} lab {_relative(checkout / 'notebooks', cwd)}",
              f"then walk {listed[0]} -> {listed[-1]} in order"),
             (f"{exe('labkit')} train --help", "every training flag"),
             (f"{exe('labkit')} check allreduce --init my_ring.py", "write the ring all-reduce yourself")]
    if shutil.which("sbatch"):
        steps.append((f"sbatch {_relative(checkout / 'jobs' / 'job_ddp.sh', cwd)}",
                      "the same runs on this GPU cluster (see jobs/README.md)"))
    return steps


def format_next_steps(steps: list[tuple[str, str]]) -> str:
    """Each command on a line of its own (copy it whole), what it does indented on the next."""
    return "\n".join(f"  {command}\n      {what}" for command, what in steps)


def _relative(path: Path, cwd: Path) -> str:
    try:
        return os.path.relpath(path, cwd)
    except ValueError:  # another drive (Windows)
        return str(path)


def add_parser(sub) -> None:
    p = sub.add_parser("tour", help="a short CPU tour of the kit (start here)", description=__doc__)
    p.add_argument("--out", default="runs/tour", help="results folder (default runs/tour)")
    p.add_argument("--epochs", type=within("int", "[1, inf)"), default=3)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.set_defaults(func=main)


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def main(args: argparse.Namespace) -> int:
    import torch

    from labkit import results
    from labkit.train.config import TrainConfig
    from labkit.train.run import run

    out = results.make_dirs(args.out)  # an unwritable --out is one line now, not after the training
    _section("1. where you are")
    print(f"torch {torch.__version__} | {os.cpu_count()} CPU cores | "
          f"{torch.cuda.device_count()} GPU(s) | training on {args.device}")

    _section("2. train LeNet on 5,000 real MNIST digits (mnist-sample)")
    cfg = TrainConfig(model="lenet", dataset="mnist-sample", epochs=args.epochs, batch_size=64, base_lr=0.05,
                      device=args.device, out=str(out / "lenet"), name="tour-lenet", log_every=20)
    summary = run(cfg)

    _section("3. results")
    run_dir = results.load_run(out / "lenet")
    plot = _plot(run_dir, out / "tour.png")
    acc = summary["metrics"]["final_test_acc"]
    print(f"final test accuracy {acc:.3f} after {len(run_dir.records_of('epoch'))} epochs")
    print(f"per-epoch metrics: {out / 'lenet' / 'metrics.jsonl'}\nsummary:           {out / 'lenet' / 'summary.json'}"
          f"\nplot:              {plot}")

    _section("4. ring all-reduce: simulated, run on 2 gloo ranks, animated")
    _allreduce(out)

    _section("5. next")
    print("Where to go next")
    print(format_next_steps(next_steps()))
    print(NOTEBOOKS)
    return 0


def _plot(run, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.results import atomic_write, plot_metric

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    plot_metric(run, y="train_loss", ax=ax1, labels=["train"])
    plot_metric(run, y="test_loss", ax=ax1, labels=["test"])
    ax1.set_ylabel("loss")
    plot_metric(run, y="test_acc", ax=ax2, labels=["test"])
    ax2.set_ylabel("accuracy")
    fig.suptitle("LeNet on mnist-sample (labkit tour)")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100), binary=True)
    plt.close(fig)
    return path


def _allreduce(out: Path) -> None:
    from labkit.collectives import get_schedule, simulate
    from labkit.collectives.verify import format_verify, verify_rank
    from labkit.dist.testing import run_ranks
    from labkit.viz.allreduce import save_animation

    schedule = get_schedule("ring", 4)
    sim = simulate(schedule, n=12)  # raises if any rank does not end with the sum
    sent = sim.counts.elements_sent
    print(f"simulated ring on 4 ranks, 12 numbers each: {schedule.num_steps} steps = 2(p-1); "
          f"each rank sent {sent[0]} numbers = 2(p-1)/p x 12; every rank holds the sum")
    rows = run_ranks(verify_rank, 2, ["ring"], timeout=180)[0]
    print("ring on 2 real gloo processes vs dist.all_reduce:")
    print(format_verify(rows, 2))
    path = save_animation(schedule, out / "ring_allreduce.html")
    print(f"animation: {path}  (open it in a browser; notebook 01 has the interactive player)")

"""ResNet-50 on MNIST with GPipe -- the ANSWER to mnist_gpipe_exercise.py, with knobs to experiment with.

    sbatch jobs/gpipe/job_gpipe_answer.sh                                   # 2 GPUs
    python jobs/gpipe/mnist_gpipe_answer.py --balance_by memory --num_microbatches 4 --batchsize 1024
    LABKIT_QUICK=1 python jobs/gpipe/mnist_gpipe_answer.py                  # a few CPU steps, offline data

Try: balancing by time vs by memory (is it visible in speed and memory?), the number of micro-batches
(more: a smaller bubble, but smaller pieces of work), and the batch size (how far can you go with and
without GPipe?).
"""
import argparse

import torch
from torch import nn
from torchgpipe import GPipe
from torchgpipe.balance import balance_by_size, balance_by_time

import labkit
from labkit.data.datasets import get_dataset
from labkit.data.loader import make_loader
from labkit.models.cnn import get_model
from labkit.results import RunWriter
from labkit.strategies.balance import compute_balance
from labkit.train.meters import ThroughputMeter, memory_lines, peak_memory_gb

# LABKIT_QUICK=1 (CI, a first try on a laptop): a small batch, fewer micro-batches and steps
BATCH_SIZE, CHUNKS = (16, 4) if labkit.quick() else (512, 8)


def build_model(devices: list[str], chunks: int = CHUNKS, balance_by: str = "time",
                batch_size: int = BATCH_SIZE) -> nn.Module:
    """ResNet-50 for 1x28x28 digits, placed on ``devices``, feeding ``chunks`` micro-batches per batch."""
    # (1) GPipe cuts an nn.Sequential: the flat form of ResNet-50 (stem, 16 bottleneck blocks, pool, fc).
    model = get_model("resnet50", in_channels=1, image_size=28, sequential=True)
    # (2) no model.to(device): GPipe moves each partition to its device.
    # (3) split it by measuring one micro-batch.
    micro_batch = torch.randn(max(2, batch_size // chunks), 1, 28, 28)
    if balance_by == "time":
        balance = balance_by_time(len(devices), model, micro_batch, device=devices[0])
    elif torch.device(devices[0]).type == "cuda":
        balance = balance_by_size(len(devices), model, torch.randn(batch_size, 1, 28, 28), chunks=chunks,
                                  device=devices[0])
    else:  # balance_by_size measures CUDA allocations; on CPU labkit estimates them from tensor sizes
        balance = compute_balance("memory", len(devices), model, micro_batch, 1, torch.device("cpu"))
    print(f"balance by {balance_by}: {balance} layers on {devices}")
    # (4) wrap it.
    return GPipe(model, balance, devices=devices, chunks=chunks)


def place_batch(x: torch.Tensor, y: torch.Tensor, devices: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a batch (x: (B, 1, 28, 28), y: (B,)) to where the model reads and writes it."""
    # (5) the input to the first device, the target to the last (where GPipe returns the output).
    return x.to(devices[0]), y.to(devices[-1])


def default_devices() -> list[str]:
    """Two GPUs if there are two, both partitions on one GPU if there is one, else two CPU partitions."""
    gpus = torch.cuda.device_count()
    return ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0"] * 2 if gpus == 1 else ["cpu"] * 2


def main(argv=None) -> None:
    quick = labkit.quick()
    parser = argparse.ArgumentParser(description="ResNet-50 on MNIST with GPipe (answer)")
    parser.add_argument("--batchsize", type=int, default=BATCH_SIZE)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--dataset", default="mnist-sample" if quick else "mnist")
    parser.add_argument("--max_steps", type=int, default=3 if quick else None, help="stop each epoch early")
    parser.add_argument("--devices", nargs="+", default=default_devices(), help="one device per partition")
    parser.add_argument("--balance_by", choices=("time", "memory"), default="time")
    parser.add_argument("--num_microbatches", type=int, default=CHUNKS)
    parser.add_argument("--out", default="runs/mnist_gpipe_answer", help="results folder (summary.json)")
    args = parser.parse_args(argv)

    devices = args.devices
    model = build_model(devices, args.num_microbatches, args.balance_by, args.batchsize)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    loader = make_loader(get_dataset(args.dataset, train=True), args.batchsize, shuffle=True)
    steps = min(len(loader), args.max_steps or len(loader))

    for epoch in range(args.epochs):
        model.train()
        meter = ThroughputMeter(epoch + 1, args.epochs, steps, every=10)
        for step, (x, y) in enumerate(loader):
            if step == steps:
                break
            x, y = place_batch(x, y, devices)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter.update(len(x))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rate = meter.finish()

    lines = memory_lines(devices)
    print("\n".join(lines))
    RunWriter(args.out).finish("mnist_gpipe_answer", "train", vars(args),
                               {"samples_per_sec": rate, "final_train_loss": loss.item(),
                                "peak_memory_gb": peak_memory_gb(devices), "memory_lines": lines,
                                "balance": model.balance})


if __name__ == "__main__":
    main()

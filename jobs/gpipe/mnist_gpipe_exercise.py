"""ResNet-50 on MNIST -- EXERCISE: make this program train with GPipe on two devices.

As it is, it is plain PyTorch on the first device (it runs). Complete the five TODOs, (1) to (5):

    (1) GPipe cuts an nn.Sequential into partitions: build the model as one.
    (2) GPipe moves every partition to its own device: remove the model's .to(device).
    (3) Decide the split: how many layers go to each device (by hand, or torchgpipe.balance).
    (4) Wrap the sequential model in torchgpipe.GPipe.
    (5) GPipe reads the input on the first device and returns the output on the last one:
        send the input to the first device and the target to the last.

Check your work at any time (it says which step is missing):

    labkit check gpipe-exercise jobs/gpipe/mnist_gpipe_exercise.py

Run it with sbatch jobs/gpipe/job_gpipe_exercise.sh (2 GPUs), or python on this machine, and compare
speed and memory with mnist_pytorch.py. Note the default batch size: 512 here, 256 there.
Don't peek at mnist_gpipe_answer.py unless you are really stuck, or done!
Guide: https://torchgpipe.readthedocs.io/en/stable/guide.html
"""
import argparse

import torch
from torch import nn
from torchgpipe import GPipe  # noqa: F401  (you need it in TODO (4))
from torchgpipe.balance import balance_by_time  # noqa: F401  (one way to do TODO (3))

import labkit
from labkit.data.datasets import get_dataset
from labkit.data.loader import make_loader
from labkit.models.cnn import get_model
from labkit.results import RunWriter
from labkit.train.meters import ThroughputMeter, memory_lines, peak_memory_gb

# LABKIT_QUICK=1 (CI, a first try on a laptop): a small batch, fewer micro-batches and steps
BATCH_SIZE, CHUNKS = (16, 4) if labkit.quick() else (512, 8)


def build_model(devices: list[str], chunks: int = CHUNKS) -> nn.Module:
    """ResNet-50 for 1x28x28 digits, placed on ``devices``, feeding ``chunks`` micro-batches per batch."""
    # TODO (1): GPipe only cuts an nn.Sequential. Ask get_model for the flat form: sequential=True.
    model = get_model("resnet50", in_channels=1, image_size=28)
    # TODO (2): GPipe puts each partition on its device itself: delete the next line.
    model = model.to(devices[0])
    # TODO (3): decide the split: a list with the number of layers per device, adding up to len(model),
    #           e.g. balance = [12, 11]; or measure it on one micro-batch:
    #           micro_batch = torch.randn(BATCH_SIZE // chunks, 1, 28, 28)
    #           balance = balance_by_time(len(devices), model, micro_batch, device=devices[0])
    # TODO (4): wrap the model: model = GPipe(model, balance, devices=devices, chunks=chunks)
    return model


def place_batch(x: torch.Tensor, y: torch.Tensor, devices: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a batch (x: (B, 1, 28, 28), y: (B,)) to where the model reads and writes it."""
    # TODO (5): the input goes to the first device (devices[0]), the target to the last (devices[-1]).
    return x.to(devices[0]), y.to(devices[0])


def default_devices() -> list[str]:
    """Two GPUs if there are two, both partitions on one GPU if there is one, else two CPU partitions."""
    gpus = torch.cuda.device_count()
    return ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0"] * 2 if gpus == 1 else ["cpu"] * 2


def main(argv=None) -> None:
    quick = labkit.quick()
    parser = argparse.ArgumentParser(description="ResNet-50 on MNIST with GPipe (exercise)")
    parser.add_argument("--batchsize", type=int, default=BATCH_SIZE)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--dataset", default="mnist-sample" if quick else "mnist")
    parser.add_argument("--max_steps", type=int, default=3 if quick else None, help="stop each epoch early")
    parser.add_argument("--devices", nargs="+", default=default_devices(), help="one device per partition")
    parser.add_argument("--out", default="runs/mnist_gpipe_exercise", help="results folder (summary.json)")
    args = parser.parse_args(argv)

    devices = args.devices
    model = build_model(devices)
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
    RunWriter(args.out).finish("mnist_gpipe_exercise", "train", vars(args),
                               {"samples_per_sec": rate, "final_train_loss": loss.item(),
                                "peak_memory_gb": peak_memory_gb(devices), "memory_lines": lines})


if __name__ == "__main__":
    main()

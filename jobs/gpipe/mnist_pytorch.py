"""ResNet-50 on MNIST with plain PyTorch on one device: the reference for the GPipe hands-on.

    sbatch jobs/gpipe/job_pytorch.sh                  # on the cluster (1 GPU)
    python jobs/gpipe/mnist_pytorch.py                # here (GPU if present, else CPU)
    LABKIT_QUICK=1 python jobs/gpipe/mnist_pytorch.py # a few steps on the offline MNIST sample

While training it prints the throughput, at the end the memory per device:

    train | epoch 1/1 (4%) | 692 samples/sec (estimated)
    train | epoch 1/1 (99%) | 718 samples/sec
    GPU 0: allocated 0.270 GB, reserved 8.074 GB

"allocated" is held by the model (parameters, gradients, optimizer state); "reserved" also by the
activations at their peak. Note the default batch size: 256 here, 512 in the GPipe versions.
"""
import argparse

import torch
from torch import nn

import labkit
from labkit.data.datasets import get_dataset
from labkit.data.loader import make_loader
from labkit.models.cnn import get_model
from labkit.results import RunWriter
from labkit.train.meters import ThroughputMeter, memory_lines, peak_memory_gb


def build_model(device: str) -> nn.Module:
    """ResNet-50 for 1x28x28 digits, on ``device``."""
    model = get_model("resnet50", in_channels=1, image_size=28)
    model = model.to(device)
    return model


def place_batch(x: torch.Tensor, y: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a batch (x: (B, 1, 28, 28), y: (B,)) to where the model reads and writes it."""
    return x.to(device), y.to(device)


def main(argv=None) -> None:
    quick = labkit.quick()
    parser = argparse.ArgumentParser(description="ResNet-50 on MNIST, plain PyTorch (the reference)")
    parser.add_argument("--batchsize", type=int, default=8 if quick else 256)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--dataset", default="mnist-sample" if quick else "mnist")
    parser.add_argument("--max_steps", type=int, default=3 if quick else None, help="stop each epoch early")
    parser.add_argument("--out", default="runs/mnist_pytorch", help="results folder (summary.json)")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(device)
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
            x, y = place_batch(x, y, device)
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter.update(len(x))
        if device == "cuda":
            torch.cuda.synchronize()
        rate = meter.finish()

    lines = memory_lines([device])
    print("\n".join(lines))
    RunWriter(args.out).finish("mnist_pytorch", "train", vars(args),
                               {"samples_per_sec": rate, "final_train_loss": loss.item(),
                                "peak_memory_gb": peak_memory_gb([device]), "memory_lines": lines})


if __name__ == "__main__":
    main()

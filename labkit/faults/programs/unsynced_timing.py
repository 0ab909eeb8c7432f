"""Data-parallel training that reports its throughput, timing every training step.

    labkit faults run unsynced-timing --device cuda    (on CPU: --device cpu, the default there)
"""
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR = 2, 32, 0.1


def main():
    device = torch.device(os.environ.get("DEVICE", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    model = toy_model(*((4096, 8) if device.type == "cuda" else (32, 1))).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    losses, seconds, samples = [], 0.0, 0
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            average_gradients(model)
            optimizer.step()
            seconds += time.perf_counter() - start
            samples += len(x)
            losses.append(loss.detach())
    print(f"rank {dist.get_rank()}: {samples / seconds:.0f} samples/s")
    dist.barrier()
    dist.destroy_process_group()
    return {"model": model, "losses": [v.item() for v in losses], "samples_per_s": samples / seconds}


if __name__ == "__main__":
    main()

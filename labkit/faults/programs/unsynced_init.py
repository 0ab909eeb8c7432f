"""Data-parallel training where each rank adds its own random noise to the inputs (a cheap augmentation).

    labkit faults run unsynced-init                (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR, NOISE = 2, 32, 0.1, 0.05


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different noise on every rank
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    losses = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x = x + NOISE * torch.randn_like(x)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            average_gradients(model)
            optimizer.step()
            losses.append(loss.item())
    dist.barrier()
    dist.destroy_process_group()
    return {"model": model, "losses": losses}


if __name__ == "__main__":
    main()

"""Data-parallel training with the recipe of a one-GPU run: batch 32, learning rate 0.05.

    labkit faults run lr-not-scaled                (or: torchrun --nproc-per-node 4 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR = 3, 32, 0.05  # tuned on one GPU


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    losses = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
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

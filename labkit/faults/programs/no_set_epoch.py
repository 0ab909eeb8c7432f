"""Data-parallel training over shuffled data for three epochs.

    labkit faults run no-set-epoch                 (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR = 3, 32, 0.1


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=True, seed=0))
    losses = []
    for epoch in range(EPOCHS):
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

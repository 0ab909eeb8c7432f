"""Data-parallel training on two replicas, one of which is lost mid-run: its node dies at step 5 of epoch 1.

    labkit faults run replica-lost                 (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import LOST, average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR, LOST_AT = 2, 32, 0.1, 5


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    losses, step = [], 0
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if rank == 1 and step == LOST_AT:
                os._exit(LOST)  # the node is gone: no exception, no goodbye
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            average_gradients(model)
            optimizer.step()
            losses.append(loss.item())
            step += 1
    dist.barrier()
    return {"model": model, "losses": losses}


if __name__ == "__main__":
    main()

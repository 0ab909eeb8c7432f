"""Data-parallel training on a data set of 257 samples, split between the ranks by hand.

    labkit faults run uneven-inputs                (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from labkit.faults.common import average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR = 1, 32, 0.1


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data(257)
    mine = torch.tensor_split(torch.arange(len(data)), world_size)[rank].tolist()  # rank 0 gets the extra one
    loader = DataLoader(Subset(data, mine), batch_size=BATCH)
    losses = []
    for epoch in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            average_gradients(model)
            optimizer.step()
            losses.append(loss.item())
        print(f"rank {rank}: epoch {epoch} done after {len(losses)} steps")
    dist.barrier()  # wait for every rank before leaving
    dist.destroy_process_group()
    return {"model": model, "losses": losses}


if __name__ == "__main__":
    main()

"""Data-parallel training started by ``srun`` (one task per GPU) without torchrun.

    labkit faults run local-rank        (emulates: srun --ntasks-per-node 2 python THIS_FILE)
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import average_gradients, toy_data, toy_model, use_gpu

EPOCHS, BATCH, LR = 2, 32, 0.1


def main():
    rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = use_gpu(local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    print(f"rank {rank} on {os.environ.get('SLURMD_NODENAME', 'this node')} uses GPU {local_rank}")
    torch.manual_seed(0)
    model = toy_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    losses = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
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

"""Data-parallel training in pairs: each rank swaps its gradients with its partner (rank XOR 1) by send/recv.

    labkit faults run send-recv-deadlock           (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import toy_data, toy_model

EPOCHS, BATCH, LR = 2, 32, 0.1


def swap_and_average(model):
    """Replace every gradient by the mean of this rank's and its partner's."""
    peer = dist.get_rank() ^ 1
    grads = [p.grad for p in model.parameters()]
    mine = torch.cat([g.flatten() for g in grads])
    theirs = torch.empty_like(mine)
    dist.send(mine, peer)
    dist.recv(theirs, peer)
    mean = (mine + theirs) / 2
    for g, part in zip(grads, mean.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    losses = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            swap_and_average(model)
            optimizer.step()
            losses.append(loss.item())
    dist.barrier()
    dist.destroy_process_group()
    return {"model": model, "losses": losses}


if __name__ == "__main__":
    main()

"""Data-parallel training where rank 0 also logs the training accuracy per class after each epoch.

    labkit faults run mismatched-collective         (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import CLASSES, average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR = 2, 32, 0.1


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = toy_data()
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    losses = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        correct = torch.zeros(CLASSES)
        for x, y in loader:
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            average_gradients(model)
            optimizer.step()
            losses.append(loss.item())
            correct += torch.bincount(y[out.argmax(1) == y], minlength=CLASSES)
        if rank == 0:  # only rank 0 prints, so only rank 0 sums the counts
            dist.all_reduce(correct)
            print(f"epoch {epoch}: correct per class {correct.int().tolist()}")
        dist.barrier()  # the epoch ends together on every rank
    dist.destroy_process_group()
    return {"model": model, "losses": losses}


if __name__ == "__main__":
    main()

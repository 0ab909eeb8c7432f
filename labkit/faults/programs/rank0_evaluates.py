"""Data-parallel training that measures the test accuracy after each epoch; only rank 0 prints it.

    labkit faults run rank0-evaluates              (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR = 2, 32, 0.1


@torch.no_grad()
def evaluate(model, test):
    """Accuracy on the test set: each rank scores its share, the counts are summed over the ranks."""
    x, y = test.tensors
    mine = slice(dist.get_rank(), None, dist.get_world_size())
    counts = torch.tensor([(model(x[mine]).argmax(1) == y[mine]).sum().item(), len(y[mine])], dtype=torch.float)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data, test = toy_data(), toy_data(256, seed=99)
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
        if rank == 0:
            print(f"epoch {epoch}: test accuracy {evaluate(model, test):.3f}")
        dist.barrier()  # the epoch ends together on every rank
    dist.destroy_process_group()
    return {"model": model, "losses": losses}


if __name__ == "__main__":
    main()

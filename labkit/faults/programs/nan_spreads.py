"""Data-parallel training on features that include a count (visits, words, ...), taken as a logarithm.

    labkit faults run nan-spreads                  (or: torchrun --nproc-per-node 2 THIS_FILE)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from labkit.faults.common import average_gradients, toy_data, toy_model

EPOCHS, BATCH, LR = 2, 32, 0.1


def with_counts(data):
    """Feature 0 becomes a count of at least 1 ... except in one sample, where nothing was counted."""
    x, y = data.tensors
    counts = torch.randint(1, 100, (len(x),), generator=torch.Generator().manual_seed(7)).float()
    counts[75] = 0
    return torch.cat([counts[:, None], x[:, 1:]], 1), y


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x_all, y_all = with_counts(toy_data())
    x_all[:, 0] = torch.log(x_all[:, 0])
    data = torch.utils.data.TensorDataset(x_all, y_all)
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))
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

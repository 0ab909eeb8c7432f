"""Rank 1 fails first, in the way ``LABKIT_FAIL`` names, while rank 0 waits in a collective for it: the program of
test_faults' first-failure test (run by labkit.faults.runner).

* ``raise``: rank 1 raises before the all-reduce rank 0 is in;
* ``unused``: rank 1's loss leaves out one of DDP's parameters, so its gradient is never all-reduced there;
* ``dtype``: rank 1 all-reduces float32 where rank 0 all-reduces float64 (rank 1 receives 8-byte elements
  into a 4-byte buffer);
* ``before-init``: rank 1 raises before ``init_process_group``, where rank 0 then waits for it, in no collective.
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class TwoHeads(nn.Module):
    """Two linear heads whose outputs are summed; with both=False only the first is used."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, both=True):
        return self.a(x) + self.b(x) if both else self.a(x)


def main():
    if os.environ["LABKIT_FAIL"] == "before-init" and os.environ["RANK"] == "1":
        raise ValueError("rank 1 failed before init_process_group")
    dist.init_process_group("gloo")
    rank, how = dist.get_rank(), os.environ["LABKIT_FAIL"]
    if how == "raise":
        if rank == 1:
            raise ValueError("rank 1 read a batch of the wrong shape")
        dist.all_reduce(torch.ones(3))
    elif how == "unused":
        model = DistributedDataParallel(TwoHeads())
        for _ in range(2):
            model(torch.ones(8, 4), both=rank != 1).sum().backward()
    elif how == "dtype":
        dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 1 else torch.float64))
    return {"model": nn.Linear(1, 1), "losses": []}

"""What ``labkit faults run`` watches inside each rank, to catch the failures that do not hang.

:func:`install` adds, for the diagnosis only (never in ``labkit train``):

* a global optimizer step hook: the step count, the learning rate, this rank's weights after its first step
  (replicas must be equal there) and the clock at the first and last step;
* a wrapper around ``dist.all_reduce`` that notes the first call whose input is not finite (this costs a
  host sync per call, which is why training runs never get it);
* a wrapper around ``DistributedSampler.__iter__`` that keeps each epoch's sample order (when it shuffles).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DistributedSampler

RECORD: dict = {"steps": 0, "lr": None, "first_step": None, "first_step_s": None, "last_step_s": None,
                "all_reduces": 0, "nonfinite": None, "orders": []}


def _after_step(optimizer, args, kwargs) -> None:
    RECORD["steps"] += 1
    RECORD["last_step_s"] = time.perf_counter()
    if RECORD["steps"] == 1:
        RECORD["lr"] = optimizer.param_groups[0]["lr"]
        RECORD["first_step_s"] = RECORD["last_step_s"]
        RECORD["first_step"] = torch.cat([p.detach().flatten().float().cpu()
                                          for g in optimizer.param_groups for p in g["params"]])


def _watch_all_reduce(fn):
    def all_reduce(tensor, *args, **kwargs):
        RECORD["all_reduces"] += 1
        if RECORD["nonfinite"] is None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            RECORD["nonfinite"] = {"step": RECORD["steps"] + 1, "call": RECORD["all_reduces"],
                                   "shape": list(tensor.shape)}
        return fn(tensor, *args, **kwargs)
    all_reduce.labkit_recorded = fn
    return all_reduce


def _watch_order(fn):
    def __iter__(self):
        order = list(fn(self))
        if self.shuffle:
            RECORD["orders"].append(order)
        return iter(order)
    __iter__.labkit_recorded = fn
    return __iter__


def install() -> None:
    register_optimizer_step_post_hook(_after_step)
    dist.all_reduce = _watch_all_reduce(dist.all_reduce)
    DistributedSampler.__iter__ = _watch_order(DistributedSampler.__iter__)


def finish() -> dict:
    """The record, with the clock read after the device finished its queued work."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return dict(RECORD, end_s=time.perf_counter())

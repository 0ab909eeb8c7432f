"""Notebook 00's exercise (``labkit check training-step FILE``): one training step, written out.

``train_step(model, optimizer, criterion, x, y)`` does one step of mini-batch SGD on the batch ``x`` (B, ...)
with labels ``y`` (B,) and returns the loss as a Python float. The checker runs it on a small network next
to the reference step and compares the loss and every weight afterwards; it names the step that is missing
(zeroing the gradients, the backward pass, the update).
"""
from __future__ import annotations

import copy
from typing import Callable

STARTER = '''\
def train_step(model, optimizer, criterion, x, y):
    """One step on the batch x (B, ...) with labels y (B,); return the loss as a float."""
    out = model(x)            # forward: (B, classes) scores
    loss = criterion(out, y)
    # TODO: clear the old gradients, compute the new ones, update the parameters
    return loss.item()
'''


def reference_step(model, optimizer, criterion, x, y) -> float:
    """The solution: zero, forward, loss, backward, update."""
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def check(train_step: Callable) -> list[str]:
    """Two steps of ``train_step`` vs :func:`reference_step` from the same weights; [] when they agree."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    before = [p.detach().clone() for p in mine.parameters()]
    for i, (x, y) in enumerate(batches, 1):
        try:
            loss = train_step(mine, opt_mine, criterion, x, y)
        except Exception as exc:  # the learner's code: say what it raised, do not crash
            return [f"train_step raised {type(exc).__name__}: {exc}"]
        want = reference_step(ref, opt_ref, criterion, x, y)
        if not isinstance(loss, float):
            return [f"train_step returned {type(loss).__name__}; return the loss as a float (loss.item())"]
        if abs(loss - want) > 1e-6:
            return [f"step {i}: loss {loss:.6f}, expected {want:.6f}: compute the loss of this batch before "
                    "updating the weights"]
        if i == 1 and all(torch.equal(a, b) for a, b in zip(before, mine.parameters())):
            missing = "loss.backward()" if all(p.grad is None for p in mine.parameters()) else "optimizer.step()"
            return [f"the weights did not change: call {missing}"]
        diff = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), ref.parameters()))
        if diff > 1e-6:
            hint = (" — the gradients of the previous step were added to this one: call optimizer.zero_grad() "
                    "first" if i == 2 else "")
            return [f"step {i}: the weights differ from a correct step by up to {diff:.3g}{hint}"]
    return []


def main(argv: list[str]) -> int:
    from labkit.exercises import command

    return command("training-step", __doc__, "train_step", check,
                   "two steps of train_step give the reference loss and weights", argv)

"""Notebook 07's exercise (``labkit check zero-stage1 FILE``): the optimizer step of ZeRO stage 1.

Each of N ranks holds the whole flat parameter buffer (P elements, padded so N divides P) and, after the
gradient reduction, the averaged gradient; but only its own slice of the optimizer state: rank r owns
elements [r·S, (r+1)·S) with S = P / N. ``zero1_step`` updates that slice with SGD + momentum and returns it;
the all-gather of every rank's slice then rebuilds the buffer. The checker plays all N ranks in one process
for a few steps and compares the gathered buffer with ``torch.optim.SGD`` over the whole buffer.
"""
from __future__ import annotations

import torch

from labkit.exercises import command

STARTER = '''\
import torch


def zero1_step(flat_param, flat_grad, momentum, rank, world, lr, mu):
    """One ZeRO-1 step on rank `rank` of `world` (SGD with momentum, torch.optim.SGD's rule).

    flat_param: (P,) every parameter, flattened (P divisible by world); do not modify it
    flat_grad:  (P,) the gradient already averaged over the ranks
    momentum:   (S,) this rank's slice of the momentum buffer, S = P // world; update it in place
    Returns the new values of this rank's slice of the parameters, shape (S,).
        buf <- mu * buf + g            (g: this rank's slice of the gradient)
        p   <- p - lr * buf
    """
    S = flat_param.numel() // world
    # TODO: take this rank's slices of flat_param and flat_grad (elements rank*S to (rank+1)*S),
    # update `momentum` in place, and return the updated parameter slice
    return flat_param[:S].clone()
'''


def reference(flat_param, flat_grad, momentum, rank, world, lr, mu):
    """The solution."""
    size = flat_param.numel() // world
    mine = slice(rank * size, (rank + 1) * size)
    momentum.mul_(mu).add_(flat_grad[mine])
    return flat_param[mine] - lr * momentum


def check(step, world: int = 3, steps: int = 3, lr: float = 0.1, mu: float = 0.9) -> list[str]:
    """Run ``step`` for every rank of ``world`` for ``steps`` steps; the problems found ([] when right)."""
    gen = torch.Generator().manual_seed(0)
    size = 7  # S: 21 parameters over 3 ranks
    flat = torch.randn(size * world, generator=gen)
    grads = [torch.randn(size * world, generator=gen) for _ in range(steps)]
    expected = torch.nn.Parameter(flat.clone())
    sgd = torch.optim.SGD([expected], lr=lr, momentum=mu)
    plain = flat.clone()
    momenta = [torch.zeros(size) for _ in range(world)]
    for g in grads:
        expected.grad = g.clone()
        sgd.step()
        plain -= lr * g
        shards = []
        for rank in range(world):
            before = flat.clone()
            try:
                shard = step(flat, g.clone(), momenta[rank], rank, world, lr, mu)
            except Exception as exc:  # the learner's code: report whatever it raised
                return [f"zero1_step raised {type(exc).__name__}: {exc}"]
            if not torch.equal(flat, before):
                return ["zero1_step modified flat_param: rank r may only change its own slice, and only through the "
                        "all-gather of the returned shards; return the new slice instead"]
            if not isinstance(shard, torch.Tensor) or shard.shape != (size,):
                got = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
                return [f"return this rank's slice of the parameters, shape ({size},) = P / world; got {got}"]
            shards.append(shard.detach())
        if all(torch.equal(shards[0], s) for s in shards[1:]):
            return ["every rank returned the same slice: rank r owns elements r*S to (r+1)*S"]
        flat = torch.cat(shards)  # the all-gather
    if torch.allclose(flat, expected.detach(), atol=1e-6):
        return []
    if torch.allclose(flat, plain, atol=1e-6):
        return ["this is plain SGD: the momentum buffer must carry over (buf <- mu * buf + g, then p <- p - lr * buf)"]
    if any(float(m.abs().sum()) == 0 for m in momenta):
        return ["a rank's momentum slice stayed zero: update `momentum` in place (momentum.mul_(mu).add_(g))"]
    worst = (flat - expected.detach()).abs().max().item()
    return [f"after {steps} steps the parameters differ from torch.optim.SGD(momentum={mu}) by up to {worst:.3g}"]


def main(argv: list[str]) -> int:
    return command("zero-stage1", __doc__, "zero1_step", check,
                   "the gathered shards equal torch.optim.SGD with momentum over the whole buffer, 3 ranks, 3 steps",
                   argv)

"""Distributed K-FAC == single-process K-FAC on the full batch.

Two gloo ranks each take half of every batch, average their gradients (by hand with ``dist.all_reduce``,
and through real DistributedDataParallel), then K-FAC averages the factors and splits the decompositions
between the ranks. The preconditioned gradients must equal those of one process on the whole batch, for
both methods and both ways of sharing (decompositions / preconditioned gradients), over several steps
with stale decompositions in between. The bytes K-FAC sends are checked against numbers worked out by hand.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.optim.kfac import distributed as kfac_dist
from labkit.optim.kfac.preconditioner import KFAC

WORLD = 2
STEPS = 4
CONFIGS = [("eigen", "decompositions", "hand"), ("inverse", "decompositions", "hand"),
           ("eigen", "gradients", "hand"), ("inverse", "gradients", "hand"), ("eigen", "decompositions", "ddp")]


# (d_in with the bias column, d_out) of net()'s layers: (19, 4), (36, 3), (28, 12), (13, 7), (8, 5); float64.
# factors: packed upper triangles d(d+1)/2 of A and G: 190+10 + 666+6 + 406+78 + 91+28 + 36+15 = 1526 numbers
# eigen: Q and λ of A and G, d² + d each: 400 + 1344 + 968 + 238 + 102 = 3052 numbers
# inverse: the two damped inverses, packed like the factors: 1526 numbers
# gradients: one d_out × d_in block per layer: 76 + 108 + 336 + 91 + 40 = 651 numbers
BYTES_PER_STEP = {("eigen", "decompositions"): {"factors": 1526 * 8, "decompositions": 3052 * 8, "gradients": 0},
                  ("inverse", "decompositions"): {"factors": 1526 * 8, "decompositions": 1526 * 8, "gradients": 0},
                  ("eigen", "gradients"): {"factors": 1526 * 8, "decompositions": 0, "gradients": 651 * 8},
                  ("inverse", "gradients"): {"factors": 1526 * 8, "decompositions": 0, "gradients": 651 * 8}}


def net() -> nn.Module:
    """Five layers of different sizes, so the owners are not a plain alternation."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, stride=2, bias=False), nn.Tanh(),
                         nn.Flatten(), nn.Linear(27, 12), nn.ReLU(), nn.Linear(12, 7), nn.ReLU(),
                         nn.Linear(7, 5)).double()


def full_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g)


def train(model: nn.Module, method: str, broadcast: str, shard=None, forward=None, average=None):
    """STEPS steps of SGD + K-FAC (factors every step, decompositions every 3); per step the preconditioned
    gradients of every layer."""
    kfac = KFAC(model, method=method, broadcast=broadcast, factor_update_freq=1, inv_update_freq=3, damping=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = full_batch(step)
        if shard is not None:
            x, y = x[shard], y[shard]
        optimizer.zero_grad()
        F.cross_entropy((forward or model)(x), y).backward()
        if average is not None:
            average(model)
        kfac.step()
        out.append([torch.cat([l.module.weight.grad.flatten()] + ([l.module.bias.grad] if l.bias else []))
                    for l in kfac.layers])
        optimizer.step()
    return out, kfac


def average_by_hand(model: nn.Module) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def on_rank(env):
    half = 8 // env.world_size
    shard = slice(env.rank * half, (env.rank + 1) * half)
    results = {}
    for method, broadcast, mode in CONFIGS:
        model = net()
        if mode == "ddp":
            wrapped = DistributedDataParallel(model)
            grads, kfac = train(model, method, broadcast, shard, forward=wrapped)
        else:
            grads, kfac = train(model, method, broadcast, shard, average=average_by_hand)
        results[(method, broadcast, mode)] = dict(grads=grads, bytes=dict(kfac.bytes_sent), owners=kfac.owners,
                                                  formula=kfac.communication_per_step(element_size=8))
    try:  # rank 1 holds a different model (as a pipeline stage would): a clear error, not a hang
        KFAC(net() if env.rank == 0 else nn.Sequential(nn.Linear(3, 2)).double())
        results["mismatch"] = None
    except ConfigError as exc:
        results["mismatch"] = str(exc)
    return results


def test_two_ranks_equal_one_process_on_the_full_batch():
    per_rank = run_ranks(on_rank, WORLD, timeout=240)
    for method, broadcast, mode in CONFIGS:
        reference, _ = train(net(), method, broadcast)  # one process, whole batch
        for rank, results in enumerate(per_rank):
            got = results[(method, broadcast, mode)]
            for step, (ours, single) in enumerate(zip(got["grads"], reference)):
                for layer, (a, b) in enumerate(zip(ours, single)):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12,
                                               msg=f"{method}/{broadcast}/{mode} rank {rank} step {step} layer {layer}")
            expected = BYTES_PER_STEP[(method, broadcast)]
            assert got["formula"] == expected  # the documented per-step formula, checked by hand
            # factors on all 4 steps, decompositions on steps 0 and 3, gradients every step ("gradients" only)
            assert got["bytes"] == {"factors": STEPS * expected["factors"],
                                    "decompositions": 2 * expected["decompositions"],
                                    "gradients": STEPS * expected["gradients"]}
            assert got["owners"] == per_rank[0][(method, broadcast, mode)]["owners"]
    assert per_rank[0][CONFIGS[0]]["owners"] == [1, 0, 1, 1, 1]  # see test_owners_balance_the_work
    for results in per_rank:
        assert "K-FAC needs the whole model on every rank" in results["mismatch"]


def test_owners_balance_the_work():
    assert kfac_dist.assign_owners([1.0] * 5, 2) == [0, 1, 0, 1, 0]  # equal costs: round-robin
    assert kfac_dist.assign_owners([1.0] * 4, 3) == [0, 1, 2, 0]
    # net()'s (d_A, d_G): costs d_A³ + d_G³ = 6923, 46683, 23680, 2540, 637. Largest first to the least
    # loaded rank: the bias-free conv to rank 0, then everything else fits on rank 1 (33780 < 46683)
    layers = [(19, 4), (36, 3), (28, 12), (13, 7), (8, 5)]
    costs = [a ** 3 + g ** 3 for a, g in layers]
    assert kfac_dist.assign_owners(costs, 2) == [1, 0, 1, 1, 1]
    assert kfac_dist.assign_owners(costs, 3) == [2, 0, 1, 2, 2]
    assert kfac_dist.assign_owners(costs, 1) == [0] * 5
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        kfac_dist.assign_owners(costs, 0)


def test_communication_formulas():
    shapes = [(19, 4), (28, 12)]  # (d_in, d_out)
    tri = lambda d: d * (d + 1) // 2
    factors = tri(19) + tri(4) + tri(28) + tri(12)
    assert kfac_dist.communication_per_step(shapes, 1, "eigen", "decompositions") == \
        {"factors": 0, "decompositions": 0, "gradients": 0}
    assert kfac_dist.communication_per_step(shapes, 4, "eigen", "decompositions") == \
        {"factors": 4 * factors, "decompositions": 4 * (19 * 19 + 19 + 4 * 4 + 4 + 28 * 28 + 28 + 12 * 12 + 12),
         "gradients": 0}
    assert kfac_dist.communication_per_step(shapes, 4, "inverse", "decompositions") == \
        {"factors": 4 * factors, "decompositions": 4 * factors, "gradients": 0}
    assert kfac_dist.communication_per_step(shapes, 2, "eigen", "gradients") == \
        {"factors": 4 * factors, "decompositions": 0, "gradients": 4 * (19 * 4 + 28 * 12)}


def test_symmetric_packing_round_trips():
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(d, d, generator=g) for d in (1, 3, 5)]
    mats = [m + m.T for m in mats]
    flat = kfac_dist.pack_symmetric(mats)
    assert flat.shape == (1 + 6 + 15,)
    for a, b in zip(kfac_dist.unpack_symmetric(flat, [1, 3, 5]), mats):
        assert torch.equal(a, b)

"""KAISA's grad-worker fraction: every f gives the single-process preconditioned gradients; the bytes each
rank moves and the decompositions it holds follow the table of ``labkit.optim.kfac_kaisa``.

One 4-rank spawn (each rank a quarter of every batch, gradients averaged with ``dist.all_reduce``) runs
f = 1/4 (memory-optimal), 1/2 (hybrid: blocks {0,1} {2,3}, columns {0,2} {1,3}) and 1 (communication-optimal).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.errors import ConfigError
from labkit.optim import kfac_kaisa
from labkit.optim.kfac import KFAC
from labkit.testing import run_ranks
from test_kfac_dist import full_batch, net

WORLD, STEPS = 4, 4
RUNS = [(0.25, "eigen"), (0.5, "eigen"), (0.5, "inverse"), (1.0, "eigen")]


def train(fraction, method, shard=None):
    """STEPS steps of SGD + K-FAC (factors every step, decompositions every 3); per step the preconditioned
    gradient of every layer, and the K-FAC object."""
    model = net()
    kfac = KFAC(model, method=method, factor_update_freq=1, inv_update_freq=3, damping=0.01,
                grad_worker_fraction=fraction)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = full_batch(step)
        if shard is not None:
            x, y = x[shard], y[shard]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if shard is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= WORLD
        kfac.step()
        out.append([torch.cat([l.module.weight.grad.flatten()] + ([l.module.bias.grad] if l.bias else []))
                    for l in kfac.layers])
        optimizer.step()
    return out, kfac


def on_rank(env):
    quarter = slice(env.rank * 2, env.rank * 2 + 2)
    results = {}
    for fraction, method in RUNS:
        grads, kfac = train(fraction, method, quarter)
        shapes = [(l.d_in, l.d_out) for l in kfac.layers]
        results[(fraction, method)] = dict(
            grads=grads, bytes=dict(kfac.bytes_sent), memory=kfac.decomposition_bytes(),
            expected=kfac_kaisa.cost_per_rank(shapes, kfac.owners, WORLD, int(fraction * WORLD), env.rank, method,
                                              element_size=8))
    try:
        KFAC(net(), grad_worker_fraction=0.3)
    except ConfigError as exc:
        results["bad"] = str(exc)
    return results


def test_every_grad_worker_fraction_gives_the_single_process_gradients(one_thread):
    per_rank = run_ranks(on_rank, WORLD, timeout=240)
    for fraction, method in RUNS:
        reference, _ = train(None, method)  # one process, whole batch
        for rank, results in enumerate(per_rank):
            got = results[(fraction, method)]
            for step, (ours, single) in enumerate(zip(got["grads"], reference)):
                for layer, (a, b) in enumerate(zip(ours, single)):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12,
                                               msg=f"f={fraction} {method} rank {rank} step {step} layer {layer}")
            expected = got["expected"]
            # decompositions on steps 0 and 3, preconditioned gradients every step
            assert got["bytes"]["decompositions"] == 2 * expected["decompositions"], (fraction, rank)
            assert got["bytes"]["gradients"] == STEPS * expected["gradients"], (fraction, rank)
            assert got["memory"] == expected["memory"], (fraction, rank)
    memory = {f: sum(r[(f, "eigen")]["memory"] for r in per_rank) for f in (0.25, 0.5, 1.0)}
    total = per_rank[0][(1.0, "eigen")]["memory"]  # f = 1: every rank holds every decomposition
    assert memory == {0.25: total, 0.5: 2 * total, 1.0: 4 * total}  # each layer held by f·W ranks
    assert per_rank[0][(1.0, "eigen")]["bytes"]["gradients"] == 0
    assert per_rank[0][(0.25, "eigen")]["bytes"]["decompositions"] == 0
    assert "f·W must divide W; choose one of 1/4, 2/4, 4/4" in per_rank[0]["bad"]


def test_grad_worker_layout():
    layout = kfac_kaisa.GradWorkerLayout(6, 2, rank=3, groups=False)
    assert layout.blocks == [[0, 1], [2, 3], [4, 5]] and layout.columns == [[0, 2, 4], [1, 3, 5]]
    assert layout.holds(2) and not layout.holds(4)
    assert layout.column_source(4) == 5 and layout.column_source(0) == 1
    with pytest.raises(ConfigError, match="choose one of 1/6, 2/6, 3/6, 6/6"):
        kfac_kaisa.grad_workers(6, 0.25)

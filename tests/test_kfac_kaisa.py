"""KAISA's grad-worker fraction: every f gives the single-process preconditioned gradients; the bytes each
rank moves and the decompositions it holds equal numbers worked out by hand (the table of
``labkit.optim.kfac.kaisa``), as does ``KFAC.communication_per_step`` on each rank.

One 4-rank spawn (each rank a quarter of every batch, gradients averaged with ``dist.all_reduce``) runs
f = 1/4 (memory-optimal), 1/2 (hybrid: blocks {0,1} {2,3}, columns {0,2} {1,3}) and 1 (communication-optimal).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_kfac_dist import full_batch, net

from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.optim.kfac import kaisa as kfac_kaisa
from labkit.optim.kfac.preconditioner import KFAC

WORLD, STEPS = 4, 4
RUNS = [(0.25, "eigen"), (0.5, "eigen"), (0.5, "inverse"), (1.0, "eigen")]

# net()'s layers as (d_A, d_G): L0 (19, 4), L1 (36, 3), L2 (28, 12), L3 (13, 7), L4 (8, 5); float64, 8 bytes a number.
# Owners on 4 ranks by d_A³ + d_G³, largest first to the least loaded: L1 -> 0, L2 -> 1, L0 -> 2, L3 -> 3, L4 -> 3.
# Eigen decomposition d² + d for each factor: L0 380+20 = 400, L1 1332+12 = 1344, L2 812+156 = 968, L3 182+56 = 238,
#   L4 72+30 = 102; all 3052.  Inverses held in full, d_A² + d_G²: L0 377, L1 1305, L2 928, L3 218, L4 89;
#   they travel as upper triangles d(d+1)/2: L0 190+10 = 200, L1 666+6 = 672, L2 406+78 = 484, L3 91+28 = 119, L4 36+15 = 51.
# Factors (upper triangles, every factor step): 200+672+484+119+51 = 1526 -> 12208 bytes on every f.
# Gradients d_A·d_G: 76+108+336+91+40 = 651 -> 5208 bytes on every rank each step, unless f = 1.
# f = 1/4: each rank holds its own layers: rank 0 L1 1344·8 = 10752, rank 1 L2 968·8 = 7744, rank 2 L0 400·8 = 3200,
#   rank 3 L3+L4 340·8 = 2720; no decomposition travels.
# f = 1/2: blocks {0, 1} hold L1, L2 and {2, 3} hold L0, L3, L4: eigen (1344+968)·8 = 18496 and (400+238+102)·8 = 5920,
#   held and broadcast in the block; inverse held (1305+928)·8 = 17864 and (377+218+89)·8 = 5472, broadcast
#   (672+484)·8 = 9248 and (200+119+51)·8 = 2960.
# f = 1: every rank holds and receives all 3052·8 = 24416; no gradient travels.
# per rank: (decomposition bytes on an inverse-update step, gradient bytes per step, decomposition bytes held)
EXPECTED = {(0.25, "eigen"): [(0, 5208, 10752), (0, 5208, 7744), (0, 5208, 3200), (0, 5208, 2720)],
            (0.5, "eigen"): [(18496, 5208, 18496)] * 2 + [(5920, 5208, 5920)] * 2,
            (0.5, "inverse"): [(9248, 5208, 17864)] * 2 + [(2960, 5208, 5472)] * 2,
            (1.0, "eigen"): [(24416, 0, 24416)] * 4}
FACTOR_BYTES = 12208


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
        results[(fraction, method)] = dict(grads=grads, bytes=dict(kfac.bytes_sent), memory=kfac.decomposition_bytes(),
                                           counted=kfac.communication_per_step(element_size=8))
    try:
        KFAC(net(), grad_worker_fraction=0.3)
    except ConfigError as exc:
        results["bad"] = str(exc)
    return results


def test_every_grad_worker_fraction_gives_the_single_process_gradients(one_thread):
    per_rank = run_ranks(on_rank, WORLD, timeout=240)
    references = {method: train(None, method)[0] for method in ("eigen", "inverse")}  # one process, whole batch
    for fraction, method in RUNS:
        reference = references[method]
        for rank, results in enumerate(per_rank):
            got = results[(fraction, method)]
            for step, (ours, single) in enumerate(zip(got["grads"], reference)):
                for layer, (a, b) in enumerate(zip(ours, single)):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12,
                                               msg=f"f={fraction} {method} rank {rank} step {step} layer {layer}")
            decompositions, gradients, held = EXPECTED[fraction, method][rank]
            # factors every step, decompositions on steps 0 and 3, preconditioned gradients every step
            assert got["bytes"] == {"factors": STEPS * FACTOR_BYTES, "decompositions": 2 * decompositions,
                                    "gradients": STEPS * gradients}, (fraction, method, rank)
            assert got["memory"] == held, (fraction, method, rank)
            assert got["counted"] == {"factors": FACTOR_BYTES, "decompositions": decompositions,
                                      "gradients": gradients}, (fraction, method, rank)
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

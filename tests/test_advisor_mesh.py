"""The mesh search, GPT and CNN: one plan's terms by hand, the search against brute force on a small space, a
synthetic topology whose best plan is known, and the explanation on a named GPU node. Pure pricing: no process."""
import itertools

import pytest

from labkit.advisor.plan import LayerProfile, MeshPlan, Profile
from labkit.advisor.search import _valid, explain, frontier, mesh_candidates, meshes
from labkit.advisor.topology import Topology, named
from labkit.collectives.cost import CostModel
from labkit.parallel.pricing import GPT_1_3B, GPTShape, price_mesh

TINY = GPTShape(n_layer=2, n_head=2, n_embd=4, vocab_size=8, seq=4, name="tiny")  # 536 parameters


def _topo(link, inter=None, nodes=1, ranks=2, flops=1e4, memory=float("inf")):
    return Topology("test", ranks, link, memory, "cuda", 1, nodes, inter, True, 1.0, flops)


def test_one_plan_by_hand():
    t = _topo(CostModel(0.01, 1e-3))
    one = price_mesh(MeshPlan(1, 1, 1, 1), TINY, t, 4)
    # 6 · 536 · 4 · 4 + 12 · 2 · 4 · 16 · 4 = 57600 FLOP at 1e4 · 0.4 FLOP/s
    assert one.time == {"compute": pytest.approx(14.4), "bubble": 0.0, "tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0,
                        "ep": 0.0}
    dp = price_mesh(MeshPlan(2, 1, 1, 1), TINY, t, 4)
    assert dp.time["compute"] == pytest.approx(7.2)
    assert dp.time["dp"] == pytest.approx(1.092)  # (2 − 1)/2 · 2 · 1072 bytes · 1e-3 + 2 · 0.01
    # the peak is at the start of backward (labkit.parallel.memory): 2 bytes of parameters, 12 of Adam, no
    # gradients yet; per block 560 saved elements of 2 bytes (b = 2, s = 4, h = 4: 4·sbh + 12·sbh + 4·sb + a·sb),
    # the head's 2·b·s·(2h + 2 + V) = 288 bytes, the ids and targets 16·b·s = 128, positions 8·s = 32, the loss 4;
    # the loss's two fp32 temporaries 2·4·b·s·V = 512. (At the end of backward: 1072 + 6432 + 1072, less.)
    assert dp.memory == {"parameters": 1072, "gradients": 0, "optimizer": 6432, "activations": 2692,
                         "temporaries": 512}
    z3 = price_mesh(MeshPlan(2, 1, 1, 1, zero=3), TINY, t, 4)
    assert z3.memory == {"parameters": 536, "gradients": 0, "optimizer": 3216, "activations": 2692,
                         "temporaries": 512}
    assert z3.time["dp"] == pytest.approx(1.628)  # 3 collectives' bytes: 1.5 · 1072 · 1e-3 + 2 · 0.01
    pipe = price_mesh(MeshPlan(1, 1, 2, 1, microbatches=4), TINY, t, 4)
    assert pipe.time["compute"] == pytest.approx(7.2) and pipe.time["bubble"] == pytest.approx(1.8)  # (p − 1)/m
    # per micro-batch (1 sequence) 2 messages of 4 · 4 · 2 bytes; the tied embedding's 2 · 8 · 4 · 2 bytes
    assert pipe.time["pp"] == pytest.approx(4 * 2 * (0.01 + 32e-3) + 128e-3)


def test_the_search_is_brute_force_on_a_small_space():
    devices, batch = 4, 8
    brute = [MeshPlan(*dims, m, z, sp, rc) for dims in itertools.product(range(1, devices + 1), repeat=4)
             for m, z, sp, rc in itertools.product((1, 2, 4, 8, 16, 32), range(4), (False, True), (False, True))
             if dims[0] * dims[1] * dims[2] * dims[3] == devices]
    brute = [p for p in brute if _valid(p, TINY, batch)]
    assert sorted(map(repr, meshes(devices, TINY, batch))) == sorted(map(repr, brute))
    # dp=4: 8; dp=2,tp=2: 16; dp=2,pp=2 (m 2, 4): 16; dp=2,cp=2: 8; tp=2,pp=2 (m 2, 4, 8): 12; tp=2,cp=2: 16
    assert len(brute) == 76
    t = _topo(CostModel(1e-3, 1e-6), ranks=4, memory=5000)
    found = mesh_candidates(TINY, t, batch)
    best = min((price_mesh(p, TINY, t, batch) for p in brute), key=lambda e: (not e.feasible, e.step_s))
    assert found[0].step_s == best.step_s and found[0].feasible
    assert sum(e.feasible for e in found) < len(found)  # the memory limit rules plans out; they come last
    assert not found[-1].feasible
    fast = frontier(found)
    assert fast[0] is found[0] and all(a.peak_bytes > b.peak_bytes for a, b in zip(fast, fast[1:]))


def test_a_synthetic_topology_with_a_known_best_plan():
    """Two nodes of two GPUs, free links inside a node, 1 ms per byte between them, compute almost free. Ranks
    are laid out pp, dp, cp, tp (tp innermost), so the outermost dimension crosses the slow link. Gradients
    (dp outermost) are the model's size; a pipeline boundary carries one micro-batch's activation each way,
    which sequence parallelism splits over tp, and tp halves the tied embedding's all-reduce: tp=2 inside the
    nodes, pp=2 across them, SP, and the most micro-batches (m = 8 of a batch of 8) for the smallest bubble."""
    gpt = GPTShape(n_layer=2, n_head=2, n_embd=64, vocab_size=8, seq=4)
    t = _topo(CostModel(0.0, 0.0), CostModel(0.0, 1e-3), nodes=2, ranks=4, flops=1e12)
    best = mesh_candidates(gpt, t, 8)[0]
    assert best.plan == MeshPlan(dp=1, tp=2, pp=2, cp=1, microbatches=8, sequence_parallel=True)
    # 8 micro-batches · 2 messages of 4 · 64 · 2 / 2 bytes, and 2 · 4 · 64 · 2 bytes of embedding, at 1 ms a byte
    assert best.time["pp"] == pytest.approx(8 * 2 * 256e-3 + 1024e-3)


def test_the_explanation_on_one_h100_node():
    t = named("h100-nvlink")
    found = mesh_candidates(GPT_1_3B, t, 64)
    text = explain(found, GPT_1_3B, t)
    assert text.startswith("on one H100 node with NVLink, a 1.3B GPT at sequence 4096: ")
    assert f"{found[0].plan.label} (" in text and " because " in text and text.count("slower") + \
        text.count("needs") == 3
    small = mesh_candidates(GPT_1_3B, named("h100-nvlink", memory_gb=8), 64)
    assert "needs" in explain(small, GPT_1_3B, named("h100-nvlink", memory_gb=8))  # a plan that does not fit


def test_tensor_and_context_parallel_terms_by_hand():
    t = _topo(CostModel(0.01, 1e-3))
    tp = price_mesh(MeshPlan(1, 2, 1, 1), TINY, t, 4)
    # b = 4 sequences, T = 4, C = 4, L = 2, 2 bytes: all-reduces of 2·((4·2 + 2)·64 + 3·16) = 1376 bytes, a ring
    # of 2 sends 2·(1/2) of them; 10 all-reduces of 2 ring steps at α = 0.01
    assert tp.time["tp"] == pytest.approx(1.376 + 0.2)
    cp = price_mesh(MeshPlan(1, 1, 1, 2), TINY, t, 4)
    # the K/V ring: L·(6·cp − 4)·b·(T/cp)·C·2 = 2·8·4·2·4·2 = 1024 bytes; 4·(cp − 1)·L = 8 messages
    assert cp.time["cp"] == pytest.approx(1.024 + 0.08)


MOE = GPTShape(n_layer=1, n_head=2, n_embd=4, vocab_size=8, seq=4, name="moe", n_expert=2, top_k=1)


def test_expert_parallel_terms_by_hand():
    # an MLP 8·16 + 5·4 = 148; a block 64 + 32 (attention, norms) + 8 (router) + 2·148 = 400; 448 in all, 296 of
    # them experts; a token passes 448 − 296 + 148 = 300
    assert (MOE.params, MOE.expert_params, MOE.active_params) == (448, 296, 300)
    t = _topo(CostModel(0.01, 1e-3))
    ep = price_mesh(MeshPlan(1, 1, 1, 1, ep=2), MOE, t, 4)
    # (6·300·4·4 + 12·1·4·16·4) FLOP = 31872 on 2 devices at 1e4 · 0.4
    assert ep.time["compute"] == pytest.approx(3.984)
    # 2 sequences = 8 tokens a rank, half of them to the other rank: 4 rows · 4 · 2 bytes, 4 exchanges = 128,
    # the counts 2·(1/2)·8 = 8; 5 all-to-alls of 1 message each
    assert ep.time["ep"] == pytest.approx(0.136 + 0.05)
    # the shared 2·152 = 304 bytes all-reduced over 2 ranks; the experts are one copy each: nothing
    assert ep.time["dp"] == pytest.approx(0.304 + 0.02)
    # at the start of backward: parameters 304 + 296/2·2 bytes; Adam 12 bytes each; no gradients yet; one block's
    # 560 saved elements of 2 bytes and the head's 452 bytes (as in test_one_plan_by_hand); the loss's 512
    assert ep.memory == {"parameters": 600, "gradients": 0, "optimizer": 3600, "activations": 1572,
                         "temporaries": 512}
    # without ep the experts' 2·296 = 592 bytes join the all-reduce: 304 + 592 = 896 bytes against the
    # all-to-all's 136 and the shared 304
    free = _topo(CostModel(0.0, 1e-3), flops=1e12)
    best = mesh_candidates(MOE, free, 4)[0].plan  # ZeRO moves the same bytes in less memory: ties go to the smaller
    assert (best.dp, best.ep, best.recompute) == (1, 2, False)
    assert price_mesh(MeshPlan(2, 1, 1, 1), MOE, free, 4).time["dp"] == pytest.approx(0.896)


def test_moe_meshes_are_brute_force_and_the_shapes_count_the_real_models():
    from labkit.models.moe import gpt_moe
    from labkit.parallel.pricing import gpt_shape

    brute = [MeshPlan(d, t, p, c, m, z, sp, rc, e) for d, t, p, c, e in itertools.product(range(1, 5), repeat=5)
             for m, z, sp, rc in itertools.product((1, 2, 4, 8, 16, 32), range(4), (False, True), (False, True))
             if d * t * p * c * e == 4]
    brute = [p for p in brute if _valid(p, MOE, 8)]
    assert sorted(map(repr, meshes(4, MOE, 8))) == sorted(map(repr, brute))
    assert len(brute) == 16  # dp=4 and dp=2,ep=2, each ZeRO 0-3 with and without recomputation
    shape = gpt_shape("gpt-moe-tiny")
    assert shape.params == 7643136  # 2 blocks of C = 128, 4 experts, vocabulary 50304, 128 positions
    assert shape.params + 2 * 128 == sum(p.numel() for p in gpt_moe("gpt-moe-tiny", 50304).parameters())  # + ln_f


def _cnn() -> Profile:
    """Four layers of 3 µs per sample each; a tiny cut after the second (8 bytes a sample) and most of the weights
    (44000 of 44800 bytes) in the last two; 50 saved bytes a sample per layer; no optimizer or loading time."""
    layers = [LayerProfile(f"l{i}", "Linear", (0.0, 1e-6), (0.0, 2e-6), params, out, 50)
              for i, (params, out) in enumerate([(400, 100), (400, 8), (40000, 40), (4000, 40)])]
    return Profile("cnn", "synthetic-mnist", 1, (2, 8), layers, 16, 0.0, 0.0, 0)


def test_cnn_meshes_are_brute_force_dp_and_pp_with_zero_stages():
    prof, devices, batch = _cnn(), 4, 8
    brute = [MeshPlan(d, 1, p, 1, m, z) for d, p in ((4, 1), (2, 2), (1, 4)) for m in (1, 2, 4, 8, 16, 32)
             for z in range(4) if batch % (d * m) == 0 and (m >= p if p > 1 else m == 1) and (z == 0 or d > 1)]
    assert len(brute) == 14  # dp=4: ZeRO 0-3; dp=2,pp=2: m 2, 4 × ZeRO 0-3; pp=4: m 4, 8
    assert sorted(map(repr, meshes(devices, prof, batch))) == sorted(map(repr, brute))
    t = _topo(CostModel(1e-3, 1e-6), ranks=4, memory=60000)
    found = mesh_candidates(prof, t, batch)
    best = min((price_mesh(p, prof, t, batch) for p in brute), key=lambda e: (not e.feasible, e.step_s))
    assert found[0].step_s == best.step_s and found[0].feasible
    assert 0 < sum(e.feasible for e in found) < len(found) and not found[-1].feasible  # the limit prunes plans
    dp = price_mesh(MeshPlan(2, 1, 1, 1), prof, t, batch)
    # 4 samples a rank: 4 layers · 3 µs · 4; one ring all-reduce of 44800 bytes between 2: 44800 · 1e-6 + 2 · 1e-3
    assert dp.time["compute"] == pytest.approx(48e-6) and dp.time["dp"] == pytest.approx(0.0468)
    assert dp.memory["parameters"] == dp.memory["optimizer"] == 44800 and dp.memory["activations"] == 800


def test_a_synthetic_topology_with_a_known_best_cnn_mesh():
    """Two nodes of two devices, free links inside a node, 1 ms per byte between them. Ranks are laid out pp, dp
    (dp innermost): dp=2 all-reduces its 44000 bytes inside a node for nothing, and pp=2 sends only the 8-byte cut
    across the nodes; dp=4 all-reduces the weights across nodes, pp=4 sends the 100-byte cut. So dp=2,pp=2, the
    most micro-batches (m = 4: the smallest bubble), ZeRO 3 (the same time, the least memory)."""
    prof = _cnn()
    t = _topo(CostModel(0.0, 0.0), CostModel(0.0, 1e-3), nodes=2, ranks=4, flops=1e12)
    found = mesh_candidates(prof, t, 8)
    best = found[0]
    assert best.plan == MeshPlan(dp=2, tp=1, pp=2, cp=1, microbatches=4, zero=3)
    # 4 micro-batches of 1 sample, the 8-byte activation forward and its gradient back at 1 ms a byte
    assert best.time["pp"] == pytest.approx(4 * 2 * 8e-3) and best.time["dp"] == 0.0
    assert best.time["compute"] == pytest.approx(4 * 6e-6) and best.time["bubble"] == pytest.approx(6e-6)
    # the second stage's 44000 bytes sharded over dp=2, three times; 2 micro-batches in flight of 2 layers · 50
    assert best.memory == {"parameters": 22000, "gradients": 22000, "optimizer": 22000, "activations": 200,
                           "buffers": 0.0, "runtime": 0.0}
    text = explain(found, prof, t)
    # pp=4: 8 micro-batches of 1 sample, 100 bytes each way; dp=4: a ring all-reduce of 44800 bytes over 4 ranks,
    # 2 · 3/4 · 44800 bytes at 1 ms (ZeRO 2: the same bytes as ZeRO 0-1 in less memory, ZeRO 3's are 1.5×)
    assert text == ("on test, cnn on synthetic-mnist: dp=2,pp=2 m=4 zero3 (64 ms/step, 0.1 MB per device) because "
                    "pp=4 m=8 is 2399% slower (pp 1600 ms against 64 ms); dp=4 zero2 is 104851% slower (dp 67200 ms "
                    "against 0 ms)")

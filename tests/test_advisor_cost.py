"""The advisor's cost terms against hand-computed numbers, and its search on cost tables with known answers."""
import math
from dataclasses import replace

import pytest

from labkit.advisor.plan import LayerProfile, Plan, Profile
from labkit.advisor.search import candidates, check_fits, price
from labkit.advisor.topology import Topology, bubble_fraction, pipeline_terms
from labkit.collectives.cost import CostModel
from labkit.errors import ConfigError

GB = 2**30


def tiny_profile(feature_layers=2, tp_pairs=((1, 2),)) -> Profile:
    """Three layers with round numbers (fwd/bwd = a + c·b seconds; bytes per sample)."""
    layers = [LayerProfile("l0", "Conv2d", (0.001, 0.0001), (0.002, 0.0002), 400, 100, 50),
              LayerProfile("l1", "Linear", (0.0, 0.001), (0.0, 0.002), 4000, 40, 20),
              LayerProfile("l2", "Linear", (0.0005, 0.0), (0.0005, 0.0), 40, 40, 0)]
    return Profile("tiny", "synthetic-mnist", 1, (2, 8), layers, 16, update_s_per_byte=1e-6, data_s_per_sample=1e-4,
                   base_bytes=0, feature_layers=feature_layers, tp_pairs=list(tp_pairs),
                   tp_hidden=[8] * len(tp_pairs))


def topo(alpha=1e-3, beta=1e-6, ranks=2, memory=float("inf")) -> Topology:
    return Topology("test", ranks, CostModel(alpha, beta, 0.0), memory, "cpu", cores=ranks)


def test_single_terms_by_hand():
    est = price(Plan("single", 1, 1, 8), tiny_profile(), topo())
    # compute: l0 0.003 + 0.0003·8, l1 0.003·8, l2 0.001
    assert est.time == pytest.approx({"compute": 0.0304, "update": 0.00444, "data": 0.0008})
    assert est.step_s == pytest.approx(0.03564)
    assert est.memory["parameters"] + est.memory["gradients"] + est.memory["optimizer"] == 13320
    assert est.memory["activations"] == pytest.approx(8 * 70)


def test_profile_sums_read_layers_s_alike_and_an_empty_s_as_none():
    prof = tiny_profile()  # saved bytes per sample 50, 20, 0; parameter bytes 400, 4000, 40
    assert (prof.saved_bytes(8), prof.saved_bytes(8, range(1, 3)), prof.params(range(1, 3))) == (560, 160, 4040)
    assert (prof.time(8, range(0)), prof.saved_bytes(8, range(0)), prof.params(range(0))) == (0, 0, 0)


def test_ddp_ring_all_reduce_by_hand():
    est = price(Plan("ddp", 2, 2, 8, (("allreduce", "ring"),), data_parallel=2), tiny_profile(), topo())
    assert est.time["compute"] == pytest.approx(0.0172)  # b = 4: 0.0042 + 0.012 + 0.001
    # 4440 bytes, ring over 2 ranks: 2 steps of one message of 2220 bytes: 2 (1e-3 + 1e-6 · 2220)
    assert est.time["communication"] == pytest.approx(0.00644)
    assert est.time["data"] == pytest.approx(0.0004)
    assert est.memory["buffers"] == 4440


def test_pipeline_bubble_and_messages_by_hand():
    prof, t = tiny_profile(), topo()
    good = price(Plan("pipeline", 2, 2, 8, (("num_microbatches", 2), ("balance", (1, 2)))), prof, t)
    # stage times (B/m = 4): 0.0042 (+ its 2 messages of 4·100 bytes: 2 (1e-3 + 4e-4) = 0.0028) and 0.013 (no
    # message): tau = 0.013 on stage 1; along the critical path stage 0 is crossed once: bubble 0.0042 + 0.0028
    assert good.time["compute"] == pytest.approx(0.026)
    assert good.time["communication"] == pytest.approx(0.0)
    assert good.time["bubble"] == pytest.approx(0.007)
    assert good.time["update"] == pytest.approx(0.00404)
    assert good.memory["parameters"] == 4040 and good.memory["activations"] == pytest.approx(160)
    bad = price(Plan("pipeline", 2, 2, 8, (("num_microbatches", 2), ("balance", (2, 1)))), prof, t)
    # stage 0: 0.0162 + 2 (1e-3 + 1e-6 · 4 · 40) = 0.01852 = tau; stage 1 (l2 alone): 0.001, the bubble
    assert bad.time["compute"] == pytest.approx(0.0324)
    assert bad.time["communication"] == pytest.approx(0.00464)
    assert bad.time["bubble"] == pytest.approx(0.001)


def test_textbook_bubble_and_the_critical_path():
    # the textbook: (p - 1) slots of the slowest stage's pace, (p - 1)/(m + p - 1) of the step
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3) and bubble_fraction(4, 8) == pytest.approx(3 / 11)
    book = pipeline_terms([0.0042, 0.013], [0.0028, 0.0], 2)
    assert book == pytest.approx({"compute": 0.026, "communication": 0.0, "bubble": 0.013})
    assert book["bubble"] / sum(book.values()) == pytest.approx(1 / 3)
    # 3 stages of 2, 5, 3 ms (messages 1, 1, 0 ms), 4 micro-batches: slots 3, 6, 3 ms, the pace 6 ms
    book = pipeline_terms([0.002, 0.005, 0.003], [0.001, 0.001, 0.0], 4)
    path = pipeline_terms([0.002, 0.005, 0.003], [0.001, 0.001, 0.0], 4, critical_path=True)
    assert book["bubble"] == pytest.approx(0.012) and path["bubble"] == pytest.approx(0.006)
    assert path["compute"] == book["compute"] == pytest.approx(0.02)
    # equal stages: the critical path is the textbook's
    equal = [0.004] * 3 + [0.005], [0.001] * 3 + [0.0]  # every slot 5 ms, the last stage's without a message
    assert pipeline_terms(*equal, 8, critical_path=True)["bubble"] == pytest.approx(3 * 0.005)
    assert pipeline_terms(*equal, 8)["bubble"] == pytest.approx(3 * 0.005)


def test_hybrid_and_tensor_parallel_by_hand():
    prof, t = tiny_profile(), topo()
    hyb = price(Plan("hybrid", 2, 2, 8, data_parallel=2), prof, t)
    assert hyb.time["compute"] == pytest.approx(0.0172)  # features on 4 samples, classifier on 8
    # gather + scatter 4·40 bytes, logits 4·40 bytes, ring all-reduce of the 4400 feature bytes
    assert hyb.time["communication"] == pytest.approx(2 * 0.00116 + 0.00116 + 2 * (0.001 + 0.0022))
    tp = price(Plan("tensor-parallel", 2, 2, 8), prof, t)
    assert tp.time["compute"] == pytest.approx(0.0054 + 0.012 + 0.001)
    # all-reduce of 8·100 input-gradient bytes and 8·40 output bytes
    assert tp.time["communication"] == pytest.approx(2 * (0.001 + 0.0004) + 2 * (0.001 + 0.00016))
    assert tp.memory["parameters"] == pytest.approx(400 + 4040 / 2)


def test_not_applicable_plans_say_why():
    prof = tiny_profile(feature_layers=None, tp_pairs=())
    assert "features" in price(Plan("hybrid", 2, 2, 8, data_parallel=2), prof, topo()).note
    assert "pair" in price(Plan("tensor-parallel", 2, 2, 8), prof, topo()).note


def _table(layers, **kw):
    base = dict(update_s_per_byte=0.0, data_s_per_sample=0.0, base_bytes=0)
    base.update(kw)
    return Profile("synthetic", "synthetic-cifar10", 1, (2, 64), layers, 3 * 32 * 32 * 4, **base)


def conv(name, per_sample=1e-3, params=10_000, out=4096):
    return LayerProfile(name, "Conv2d", (0.0, per_sample / 3), (0.0, 2 * per_sample / 3), params, out, 4 * out)


def test_huge_fc_layer_makes_hybrid_or_tensor_parallel_win():
    fc = LayerProfile("fc", "Linear", (0.0, 1e-5), (0.0, 2e-5), 400 * 2**20, 4096, 4096)
    head = LayerProfile("head", "Linear", (0.0, 1e-6), (0.0, 2e-6), 4096 * 40, 40, 40)
    prof = _table([conv("c1"), conv("c2"), conv("c3"), fc, LayerProfile("relu", "ReLU", (0, 0), (0, 0), 0, 4096, 0),
                   head], feature_layers=3, tp_pairs=[(3, 5)], tp_hidden=[1024])
    best = candidates(lambda p: prof, topo(alpha=1e-4, beta=1e-9), 64)[0]
    assert best.plan.strategy in ("hybrid", "tensor-parallel")


def test_tiny_model_on_a_slow_link_stays_on_one_device():
    prof = _table([conv("c1", 1e-5, 100, 64), conv("c2", 1e-5, 100, 64)])
    ranked = candidates(lambda p: prof, topo(alpha=1.0, beta=1e-3, ranks=4), 64)
    assert ranked[0].plan.strategy == "single"
    fast = candidates(lambda p: prof, topo(alpha=0.0, beta=0.0, ranks=4), 64)
    assert fast[0].plan.strategy == "ddp" and fast[0].plan.processes == 4


def test_memory_limit_leaves_the_pipeline():
    half = [LayerProfile(f"fc{i}", "Linear", (0.0, 1e-4), (0.0, 2e-4), GB // 2, 4096, 64) for i in range(2)]
    prof = _table(half)
    ranked = candidates(lambda p: prof, topo(memory=2.5 * GB), 64)
    feasible = [e for e in ranked if e.feasible]
    assert feasible[0].plan.strategy == "pipeline"
    assert {e.plan.strategy for e in ranked if not e.feasible} >= {"single", "ddp"}
    assert ranked.index(feasible[-1]) < ranked.index(next(e for e in ranked if not e.feasible))
    tight = candidates(lambda p: prof, topo(memory=0.1 * GB), 64)
    with pytest.raises(ConfigError, match=r"no plan fits in 0.1 GB per device; the smallest needs 1.5\d* GB"):
        check_fits(tight, 0.1)


def test_exhaustive_balance_equals_brute_force():
    prof = _table([conv(f"c{i}", 1e-3 * (i % 3 + 1), out=1024 * (i + 1)) for i in range(6)])
    best = min((e for e in candidates(lambda p: prof, topo(ranks=3), 12, ("pipeline",))
                if e.plan.processes == 3), key=lambda e: e.step_s)
    brute = min(price(Plan("pipeline", 3, 3, 12, (("num_microbatches", m), ("balance", (a, b, 6 - a - b)))), prof,
                      topo(ranks=3)).step_s
                for m in (2, 4) for a in range(1, 5) for b in range(1, 6 - a))
    assert math.isclose(best.step_s, brute)


def test_two_level_topology_prices_collectives_across_nodes_with_the_slower_link():
    fast, slow = CostModel(1e-5, 1e-10), CostModel(1e-3, 1e-8)
    two_nodes = Topology.gpu_node(2, nodes=2, link=fast, inter=slow, compute_scale=1.0)
    assert two_nodes.ranks == 4
    assert two_nodes.link_of("p2p", 2) is fast and two_nodes.link_of("p2p", 4) is slow
    prof = tiny_profile()
    inside = price(Plan("ddp", 2, 2, 8, (("allreduce", "ring"),), data_parallel=2), prof, two_nodes).time["communication"]
    across = price(Plan("ddp", 4, 4, 8, (("allreduce", "ring"),), data_parallel=4), prof, two_nodes).time["communication"]
    assert inside == pytest.approx(2 * (1e-5 + 1e-10 * 2220))          # ring over 2: 2 steps of 4440/2 bytes
    assert across == pytest.approx(6 * (1e-3 + 1e-8 * 1112))           # ring over 4: 6 steps of 4440/4 bytes


def test_zero_and_fsdp_terms_by_hand():
    prof, t = tiny_profile(), topo()
    # units of 400, 4000, 40 bytes; over 2 ranks RS(U) = AG(U) = 1e-3 + 1e-6 · U/2. FSDP2: per unit; ZeRO: per
    # bucket, all three in one 25 MB bucket of 4440 bytes, or with --bucket-mb 0.004 (4194 bytes, filled from the
    # last unit back) two: [400] and [4000, 40]
    one = sum(1e-3 + 1e-6 * u / 2 for u in (400, 4000, 40))
    bucket = 1e-3 + 1e-6 * 4440 / 2
    z2 = price(Plan("zero", 2, 2, 8, (("zero_stage", 2),), data_parallel=2), prof, t)
    assert z2.time["communication"] == pytest.approx(2 * bucket)
    assert z2.time["update"] == pytest.approx(1e-6 * 4440 / 2)
    assert (z2.memory["parameters"], z2.memory["gradients"], z2.memory["optimizer"]) == (4440, 2220, 2220)
    small = price(Plan("zero", 2, 2, 8, (("zero_stage", 2), ("bucket_mb", 0.004)), data_parallel=2), prof, t)
    assert small.time["communication"] == pytest.approx(2 * (2e-3 + 1e-6 * (400 + 4040) / 2))
    z3 = price(Plan("zero", 2, 2, 8, (("zero_stage", 3),), data_parallel=2), prof, t)
    assert z3.time["communication"] == pytest.approx(3 * bucket)
    assert (z3.memory["parameters"], z3.memory["buffers"]) == (2220, 8880)
    fsdp = price(Plan("fsdp", 2, 2, 8, (("fsdp_no_reshard", True),), data_parallel=2), prof, t)
    assert fsdp.time["communication"] == pytest.approx(2 * one)
    assert Plan("fsdp", 2, 2, 8, (("fsdp_no_reshard", True),), data_parallel=2).train_args("lenet", "mnist-sample")[-1] == \
        "--fsdp-no-reshard"


def test_parameter_server_terms_by_hand():
    prof, t = tiny_profile(), topo(ranks=3)
    one = price(Plan("ps", 3, 3, 8, (("ps_servers", 1),), data_parallel=2), prof, t)
    assert one.plan.per_rank_batch == 4 and one.plan.label == "ps×3 S=1"
    assert one.time["compute"] == pytest.approx(0.0172)  # 2 workers, b = 4, as ddp's
    # the server takes 2 pushes of 4440 bytes and sends 2 replies (16-byte header + 4440 bytes):
    # 2 (2 (1e-3 + 1e-6 · 4440) + (1e-3 + 1e-6 · 16))
    assert one.time["communication"] == pytest.approx(0.023792)
    assert one.time["update"] == pytest.approx(0.00444) and one.time["data"] == pytest.approx(0.0004)
    # the server is the fuller device: 3 · 4440 (shard, gradient, momentum) + 2 · 2 · 4440 (pushes, stack)
    assert one.peak_bytes == pytest.approx(31080) and one.memory["optimizer"] == 4440
    two = price(Plan("ps", 3, 3, 8, (("ps_servers", 2),), data_parallel=1), prof, t)
    # shards of whole layers, largest first: 4000 | 400 + 40; one worker trains all 8 samples
    assert two.plan.per_rank_batch == 8 and two.time["compute"] == pytest.approx(0.0304)
    assert two.time["communication"] == pytest.approx(2 * (1e-3 + 1e-6 * 4000) + (1e-3 + 1e-6 * 16))
    assert two.time["update"] == pytest.approx(0.004)
    assert Plan("ps", 3, 3, 8, (("ps_servers", 2),), data_parallel=1).train_args("lenet", "mnist-sample")[-4:] == \
        ["--batch-size", "8", "--ps-servers", "2"]
    assert "fewer layers" in price(Plan("ps", 5, 5, 8, (("ps_servers", 4),), data_parallel=1), prof, topo(ranks=5)).note


def test_parameter_server_loses_on_a_slow_link_and_wins_when_the_update_dominates():
    big = _table([conv("c1", 1e-4, 20 * 2**20), conv("c2", 1e-4, 20 * 2**20)])
    ranked = candidates(lambda p: big, topo(alpha=1e-4, beta=1e-8, ranks=3), 60, ("ddp", "ps"))
    ps = next(e for e in ranked if e.plan.label == "ps×3 S=1")
    ddp = next(e for e in ranked if e.plan.strategy == "ddp" and e.plan.processes == 3)
    # one server's link carries 2W·P = 160 MB per step (W = 2 workers) where a
    # ring rank sends and receives 2(p-1)/p·P = 53 MB
    assert ranked[0].plan.strategy == "ddp" and ps.main_term == "communication"
    assert ps.time["communication"] == pytest.approx(3 * ddp.time["communication"], rel=0.01)
    # an optimizer step far dearer than the gradients: two servers each step half of the weights, while every
    # ddp rank steps them all (the link is free here)
    heavy = _table([conv("c1", 1e-6, 2**20), conv("c2", 1e-6, 2**20)], update_s_per_byte=1e-6)
    best = candidates(lambda p: heavy, topo(alpha=0.0, beta=0.0, ranks=3), 60, ("single", "ddp", "ps"))[0]
    assert best.plan.label == "ps×3 S=2" and best.time["update"] == pytest.approx(1e-6 * 2**20)


def test_buffer_broadcasts_and_ddp_buckets_by_hand():

    from labkit.advisor.topology import bucketed_allreduce

    prof, t = tiny_profile(), topo()
    # l0 as a batch-norm-like layer: 3 buffers of 264 bytes in all (two of 32 floats and a step counter)
    prof.layers[0] = replace(prof.layers[0], buffers=3, buffer_bytes=264)
    one = sum(1e-3 + 1e-6 * u / 2 for u in (400, 4000, 40))
    z2 = price(Plan("zero", 2, 2, 8, (("zero_stage", 2),), data_parallel=2), prof, t)
    # ZeRO (one bucket of 4440 bytes) broadcasts each buffer before every forward: 3 α + β · 264
    assert z2.time["communication"] == pytest.approx(2 * (1e-3 + 1e-6 * 4440 / 2) + 3e-3 + 264e-6)
    fsdp = price(Plan("fsdp", 2, 2, 8, (("fsdp_no_reshard", True),), data_parallel=2), prof, t)
    assert fsdp.time["communication"] == pytest.approx(2 * one)  # FSDP leaves buffers alone
    # PyTorch's DDP broadcasts the buffers once, coalesced; the kit's hand-made all-reduce does not
    ddp = price(Plan("ddp", 2, 2, 8, (("allreduce", "ddp"),), data_parallel=2), prof, t)
    assert ddp.time["communication"] == pytest.approx(0.00644 + 1e-3 + 264e-6)
    ring = price(Plan("ddp", 2, 2, 8, (("allreduce", "ring"),), data_parallel=2), prof, t)
    assert ring.time["communication"] == pytest.approx(0.00644)
    # DDP's first bucket holds 1 MiB: 3 MiB leave in two all-reduces (2α + β·n each, on 2 ranks), the
    # hand-made ring sends one 3 MiB bucket
    fast = topo(alpha=1e-3, beta=1e-9)
    assert bucketed_allreduce(3 * 2**20, 2, "ddp", fast) == pytest.approx(4e-3 + 3 * 2**20 * 1e-9)
    assert bucketed_allreduce(3 * 2**20, 2, "ring", fast) == pytest.approx(2e-3 + 3 * 2**20 * 1e-9)


def test_gpipe_on_one_cpu_terms_by_hand():
    prof = tiny_profile()
    est = price(Plan("gpipe", 1, 2, 8, (("num_microbatches", 2), ("balance", (1, 2)))), prof, topo())
    # B/m = 4: T_all(4) = l0 0.0042 + l1 0.012 + l2 0.001 = 0.0172, twice; no bubble on one CPU
    assert est.time["compute"] == pytest.approx(0.0344)
    # one micro-batch recomputed (except_last): forwards at 4 samples 0.0014 + 0.004 + 0.0005
    assert est.time["recompute"] == pytest.approx(0.0059)
    # the second micro-batch's input needs a gradient (torchgpipe's fork/join): l0's backward, 0.002 + 0.0002·4
    assert est.time["input gradient"] == pytest.approx(0.0028)
    assert est.step_s == pytest.approx(0.0344 + 0.0059 + 0.0028 + 0.00444 + 0.0008)
    # manual model parallelism has no fork/join, no recomputation
    mp = price(Plan("model-parallel", 1, 2, 8, (("mp_split_points", (1,)),)), prof, topo())
    assert "input gradient" not in mp.time and "recompute" not in mp.time
    # on GPUs the input gradient belongs to stage 0: (0.0042 + 0.0028 / 2) + 2 messages of 4·100 bytes
    gpus = replace(topo(), separate_devices=True)
    on_gpus = price(Plan("gpipe", 1, 2, 8, (("num_microbatches", 2), ("balance", (1, 2)))), prof, gpus)
    assert on_gpus.time["compute"] == pytest.approx(2 * 0.013)  # stage 1 (0.013) is still the slower
    prof.layers[0] = replace(prof.layers[0], bwd=(0.0186, 0.0002))  # l0: 0.0014 + 0.0194 at 4 samples
    slow0 = price(Plan("gpipe", 1, 2, 8, (("num_microbatches", 2), ("balance", (1, 2)))), prof, gpus)
    assert slow0.time["compute"] == pytest.approx(2 * (0.0208 + 0.0097))  # now stage 0: 0.0208 + 0.0194 / 2
    # along the critical path the bubble is stage 1's slot once
    assert slow0.time["bubble"] == pytest.approx(0.013)
    assert not any("overhead" in term for term in slow0.time)  # torchgpipe's own work is not priced


def test_profile_levels_are_the_loops_own_step(monkeypatch):
    """The level at each size is the lower quartile of 9 windows of :func:`labkit.train.loop.train_step` itself
    (really run, with ``labkit train``'s scheduler); the optimizer's price per parameter byte beside it."""
    import torch
    from torch import nn

    from labkit.advisor import measure as profile
    from labkit.train import loop as train

    windows = [0.010, 0.012, 0.011, 0.030, 0.010, 0.013, 0.011, 0.012, 0.010,   # 2 samples: 9 windows
               0.020, 0.021, 0.022, 0.020, 0.025, 0.021, 0.020, 0.050, 0.023]   # 8 samples

    def fake_timed(fn, n, quantile=0.5, window_s=0.0, setup=None):
        fn()  # everything timed really runs
        if fn.__qualname__ == "SGD.step":
            return 1e-6
        if n != 9:  # the loader, the warm-up windows
            return 0.0
        got = [windows.pop(0) for _ in range(n)]
        return sorted(got)[round(quantile * (n - 1))]

    schedulers, real = [], train.train_step

    def spy(*args, **kwargs):
        schedulers.append(type(kwargs["scheduler"]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(profile, "train_step", spy)
    monkeypatch.setattr(profile, "timed", fake_timed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    data, update, steps = profile.loop_costs(model, "synthetic-mnist", (2, 8), 5)
    assert steps == [0.010, 0.020]  # the lower quartile of each size's 9 windows
    assert not windows
    assert set(schedulers) == {"LambdaLR"} and len(schedulers) >= 4  # train_step itself, with a scheduler
    assert update == pytest.approx(1e-6 / (784 * 10 * 4 + 40))


def test_profile_times_the_first_layer_as_training_runs_it():
    """A training step never asks the first layer for its input's gradient (the data needs none): the profile
    times that layer, forward and backward, without it; every later layer's input needs a gradient, as in training."""
    import torch
    from torch import nn

    from labkit.advisor import measure as profile

    asked = set()
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))
    for layer in model:  # every call of a layer: its forward timed, the forward before its timed backward
        layer.register_forward_pre_hook(lambda m, args: asked.add((type(m).__name__, args[0].requires_grad)))
    times = profile._layer_times(model, torch.randn(2, 1, 4, 4), repeats=1)
    assert sorted(asked) == [("Conv2d", False), ("Flatten", True), ("Linear", True), ("ReLU", True)]
    assert len(times) == 4
    # the mlp starts with a Flatten: no parameters and an input without a gradient, so it has no backward to time
    times = profile._layer_times(nn.Sequential(nn.Flatten(), nn.Linear(16, 3)), torch.randn(2, 1, 4, 4), repeats=1)
    assert times[0][1] == 0.0 and times[1][1] > 0 and [t[2] for t in times] == [64, 12]


def test_profile_levels_are_timed_with_as_many_processes_as_fill_the_cores(monkeypatch):
    """A one-thread profile prices plans whose ranks all compute at once; a two-thread one the one-process plans."""
    from labkit.advisor import measure as profile

    monkeypatch.setattr(profile.os, "cpu_count", lambda: 8)
    assert [profile.copies(t) for t in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]
    monkeypatch.setattr(profile.os, "cpu_count", lambda: 2)
    assert [profile.copies(t) for t in (1, 2)] == [2, 1]


def test_no_plan_pays_a_per_step_stop_check():
    """`labkit train` asks about a stop signal every few tenths of a second without blocking (tests/
    test_step_collectives.py counts it): no plan, of one process or several, pays a per-step term for it."""
    t = topo()
    for plan in (Plan("ddp", 2, 2, 8, (("allreduce", "ring"),), data_parallel=2), Plan("tensor-parallel", 2, 2, 8),
                 Plan("pipeline", 2, 2, 8, (("num_microbatches", 2), ("balance", (1, 2)))),
                 Plan("zero", 2, 2, 8, (("zero_stage", 3),), data_parallel=2), Plan("ps", 2, 2, 8, (("ps_servers", 1),), data_parallel=1),
                 Plan("single", 1, 1, 8), Plan("gpipe", 1, 2, 8, (("num_microbatches", 2), ("balance", (1, 2))))):
        assert "stop check" not in price(plan, tiny_profile(), t).time, plan.label


def test_two_ranks_on_two_cores_are_never_priced_more_than_twice_as_fast_as_one_process():
    """Issue seen in notebook 08: one process (profiled at 2 threads while other programs held the cores) at
    47 ms/step beside two ranks (profiled at 1 thread) at 13.7 ms. Work is conserved both ways: one process
    does at least what it does on one thread, two ranks at most twice that."""
    slow = [LayerProfile("l0", "Conv2d", (0.0, 0.0013), (0.0, 0.0013), 400, 100, 50)]  # 2.6 ms/sample, 2 threads
    fast = [LayerProfile("l0", "Conv2d", (0.0, 0.0001), (0.0, 0.0001), 400, 100, 50)]  # 0.2 ms/sample, 1 thread
    profs = {2: Profile("m", "d", 2, (2, 8), slow, 16, 0.0, 0.0, 0),
             1: Profile("m", "d", 1, (2, 8), fast, 16, 0.0, 0.0, 0)}
    t = Topology("2 cores", 2, CostModel(0.0, 0.0, 0.0), float("inf"), "cpu", cores=2)
    table = candidates(lambda q: profs[t.threads(q)], t, 32, ("single", "ddp"))
    step = {e.plan.strategy: e.step_s for e in table}
    assert step["single"] == pytest.approx(0.0064)  # 32 · 0.2 ms on one thread, not 32 · 2.6 ms on two
    assert step["ddp"] == pytest.approx(0.0032)  # 16 · 0.2 ms
    assert step["single"] / step["ddp"] <= 2.0
    # a 2-rank profile that promises more than the cores can do is raised to the one-thread step over 2 cores
    quick = Profile("m", "d", 1, (2, 8), [LayerProfile("l0", "Conv2d", (0.0, 0.00001), (0.0, 0.00001), 400, 100,
                                                       50)], 16, 0.0, 0.0, 0)
    assert price(Plan("ddp", 2, 2, 32, data_parallel=2), quick, t, profs[1]).step_s == pytest.approx(0.0032)  # not 0.32 ms
    # off the CPU the devices are separate: nothing is raised
    gpu = Topology("2 gpus", 2, CostModel(0.0, 0.0, 0.0), float("inf"), "cuda", separate_devices=True)
    assert price(Plan("ddp", 2, 2, 32, data_parallel=2), profs[1], gpu, profs[2]).step_s == pytest.approx(0.0032)


def test_named_topologies_from_public_specifications():
    from labkit.advisor.topology import named

    h100 = named("h100-nvlink")
    assert (h100.ranks, h100.memory_bytes, h100.flops, 1 / h100.link.beta) == (8, 80 * GB, 989e12, 450e9)
    two = named("h100-2x-ib")
    assert two.ranks == 16 and two.link_of("p2p", 8) is two.link and 1 / two.link_of("p2p", 9).beta == 50e9
    assert 1 / named("a100-pcie").link.beta == 25e9
    with pytest.raises(ConfigError, match="unknown topology 'dgx'"):
        named("dgx")


def test_one_timing_helper_windows_quantile_and_setup(monkeypatch):
    """``measure.timed``: one untimed call sizes the windows (4 ms, so 3 calls fill 10 ms), then each window's
    mean per call (10, 4 and 6 ms), the median of them; ``setup`` runs before every window, untimed."""
    from labkit.advisor import measure

    clock = iter([0.0, 0.004, 1.0, 1.030, 2.0, 2.012, 3.0, 3.018])
    monkeypatch.setattr(measure, "perf_counter", lambda: next(clock))
    setups, calls = [], []
    got = measure.timed(calls.append, 3, 0.5, window_s=0.01, setup=lambda: setups.append(0) or len(setups))
    assert got == pytest.approx(0.006)
    assert calls == [1, 2, 2, 2, 3, 3, 3, 4, 4, 4] and len(setups) == 4

"""What every plan pays for sharing the machine, in literal numbers: the measured slowdown ``κ`` of processes
computing at once (on the compute of every plan of several processes, none of one), the measured price of each
kind of collective (the same for every strategy that makes it), and work conservation (2 ranks on 2 cores never
priced more than twice as fast as one process)."""
from dataclasses import replace

import pytest

from labkit.advisor.plan import LayerProfile, Plan, Profile
from labkit.advisor.search import candidates, price
from labkit.advisor.topology import Topology, compute_scale
from labkit.collectives.cost import CostModel


def profile(concurrency=2.0) -> Profile:
    """Two layers of 1 ms per sample (fwd + bwd), 1,000 parameter bytes each, one thread; no other cost."""
    layers = [LayerProfile(f"fc{i}", "Linear", (0.0, 0.0004), (0.0, 0.0006), 1000, 40, 20) for i in range(2)]
    return Profile("m", "d", 1, (2, 8), layers, 16, 0.0, 0.0, 0, tp_pairs=[(0, 1)], tp_hidden=[10],
                   concurrency=concurrency)


def cpu(cores=2, ranks=2) -> Topology:
    return Topology("cpu", ranks, CostModel(0.0, 0.0, 0.0), float("inf"), "cpu", cores=cores)


def test_kappa_scales_the_compute_of_every_plan_of_several_processes_and_of_none_of_one():
    prof = profile(concurrency=1.8)
    steps = {label: price(plan, prof, cpu()).time["compute"] for label, plan in {
        "single": Plan("single", 1, 1, 16),
        "ddp": Plan("ddp", 2, 2, 16, (("allreduce", "ring"),), data_parallel=2),
        "zero": Plan("zero", 2, 2, 16, (("zero_stage", 1),), data_parallel=2),
        "tp": Plan("tensor-parallel", 2, 2, 16),
        "ps": Plan("ps", 2, 2, 16, (("ps_servers", 1),), data_parallel=1),
        "gpipe": Plan("gpipe", 1, 2, 16, (("num_microbatches", 2), ("balance", (1, 1)))),
    }.items()}
    assert steps["single"] == pytest.approx(0.032)  # 2 layers · 16 samples · 1 ms, alone
    assert steps["ddp"] == pytest.approx(0.0288)    # 1.8 · 2 layers · 8 samples · 1 ms
    assert steps["zero"] == pytest.approx(0.0288)
    assert steps["tp"] == pytest.approx(0.0288)     # both layers sliced: 1.8 · 2 · 8 samples · 1 ms
    assert steps["ps"] == pytest.approx(0.032)      # one worker computes while the server sleeps: alone
    assert steps["gpipe"] == pytest.approx(0.032)   # one process: 2 micro-batches of 8 alone
    # κ is a CPU's: separate devices (GPUs) pay none of it; 4 cores at 1 thread: κ measured over 4
    # processes, 2 of them pay a third of it (1 + 0.9·1/3)
    gpu = Topology("gpus", 2, CostModel(0.0, 0.0, 0.0), float("inf"), "cuda", separate_devices=True)
    assert compute_scale(gpu, 2, prof) == 1.0
    assert compute_scale(cpu(cores=4, ranks=4), 2, profile(concurrency=1.9)) == pytest.approx(1.3)
    assert compute_scale(cpu(cores=4, ranks=4), 4, profile(concurrency=1.9)) == pytest.approx(1.9)
    assert compute_scale(cpu(cores=2, ranks=4), 4, prof) == pytest.approx(3.6)  # 2 oversubscribed · 1.8


def test_each_kind_of_collective_pays_its_measured_price_whatever_the_strategy():
    """p2p α 1 ms, β 1 ns/B; PyTorch's all-reduce α 2 ms, β 10 ns/B; reduce-scatter α 3 ms, β 20 ns/B;
    all-gather α 4 ms, β 30 ns/B. Two layers of 1,000 bytes, 2 ranks: every message of a ring counts."""
    kinds = {"all_reduce": CostModel(2e-3, 1e-8), "reduce_scatter": CostModel(3e-3, 2e-8),
             "all_gather": CostModel(4e-3, 3e-8)}
    t = replace(cpu(), link=CostModel(1e-3, 1e-9), kinds=kinds)
    prof = profile(concurrency=1.0)
    comm = {label: price(plan, prof, t).time["communication"] for label, plan in {
        "ddp": Plan("ddp", 2, 2, 16, (("allreduce", "ddp"),), data_parallel=2),
        "ring": Plan("ddp", 2, 2, 16, (("allreduce", "ring"),), data_parallel=2),
        "zero2": Plan("zero", 2, 2, 16, (("zero_stage", 2),), data_parallel=2),
        "zero3": Plan("zero", 2, 2, 16, (("zero_stage", 3),), data_parallel=2),
        "fsdp-no-reshard": Plan("fsdp", 2, 2, 16, (("fsdp_no_reshard", True),), data_parallel=2),
        "tp": Plan("tensor-parallel", 2, 2, 16),
    }.items()}
    # PyTorch's all-reduce of 2,000 bytes: 2 messages of α 2 ms, 2,000 bytes of 10 ns
    assert comm["ddp"] == pytest.approx(2 * 2e-3 + 2000 * 1e-8)
    # the kit's ring: 2 point-to-point steps of 1,000 bytes each
    assert comm["ring"] == pytest.approx(2 * 1e-3 + 2000 * 1e-9)
    # FSDP2 per unit (2 of 1,000 bytes): a reduce-scatter (3 ms + 500 · 20 ns) and one all-gather (4 ms + 500 · 30 ns)
    one = 3e-3 + 500 * 2e-8 + 4e-3 + 500 * 3e-8
    assert comm["fsdp-no-reshard"] == pytest.approx(2 * one)
    # ZeRO per bucket: both units in one 25 MB bucket of 2,000 bytes, the same collectives on twice the bytes
    bucket = 3e-3 + 1000 * 2e-8 + 4e-3 + 1000 * 3e-8
    assert comm["zero2"] == pytest.approx(bucket)
    assert comm["zero3"] == pytest.approx(bucket + 4e-3 + 1000 * 3e-8)  # gathers again before backward
    # tensor parallelism all-reduces 16 samples · 40 bytes forward and 16 · 16 input bytes backward
    assert comm["tp"] == pytest.approx(2 * 2e-3 + 640 * 1e-8 + 2 * 2e-3 + 256 * 1e-8)
    assert not any("overhead" in term for plan in comm for term in price(Plan("fsdp", 2, 2, 16, data_parallel=2), prof, t).time)


def test_two_ranks_on_two_cores_are_never_priced_more_than_twice_as_fast_as_one_process():
    """Whatever κ a busy moment measured, even one below 1: 2 ranks do at most twice one process's work."""
    for kappa in (0.25, 1.0, 2.0):
        prof = profile(concurrency=kappa)
        t = cpu()
        table = candidates(lambda q, p=prof: replace(p, threads=t.threads(q)), t, 32, ("single", "ddp"))
        step = {e.plan.strategy: e.step_s for e in table}
        assert step["single"] == pytest.approx(0.064)  # 2 layers · 32 samples · 1 ms
        assert step["ddp"] == pytest.approx({0.25: 0.032, 1.0: 0.032, 2.0: 0.064}[kappa])
        assert step["single"] / step["ddp"] <= 2.0


def test_a_kinds_fit_is_per_message_and_per_byte_of_its_ring():
    """``T(n) = 1 ms + 2 ns·n`` measured: a reduce-scatter over 4 ranks sends 3 messages and 3/4 of the buffer,
    so α = 1/3 ms and β = 2/(3/4) ns; over 2 ranks one message and half the buffer; a ring step one and all."""
    from labkit.advisor.measure import fit_kind

    points = [(1000, 1e-3 + 2e-9 * 1000), (10**6, 1e-3 + 2e-9 * 10**6)]
    assert fit_kind("reduce_scatter", points, 4) == pytest.approx((1e-3 / 3, 2e-9 / 0.75))
    assert fit_kind("reduce_scatter", points, 2) == pytest.approx((1e-3, 4e-9))
    assert fit_kind("all_reduce", points, 2) == pytest.approx((0.5e-3, 2e-9))
    assert fit_kind("broadcast", points, 3) == pytest.approx((0.5e-3, 1e-9))
    assert fit_kind("p2p", points, 8) == pytest.approx((1e-3, 2e-9))

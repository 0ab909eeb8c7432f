"""What every plan pays for sharing the machine, in literal numbers: the measured slowdown ``κ`` of processes
computing at once (on the compute of every plan of several processes, none of one), FSDP2's own work per unit,
and work conservation (2 ranks on 2 cores never priced more than twice as fast as one process)."""
from dataclasses import replace

import pytest

from labkit.advisor.alphabeta import compute_scale
from labkit.advisor.plan import LayerProfile, Plan, Profile
from labkit.advisor.search import candidates, price
from labkit.advisor.topology import Topology
from labkit.collectives.cost import CostModel


def profile(concurrency=2.0, fsdp_unit=0.0) -> Profile:
    """Two layers of 1 ms per sample (fwd + bwd), 1,000 parameter bytes each, one thread; no other cost."""
    layers = [LayerProfile(f"fc{i}", "Linear", (0.0, 0.0004), (0.0, 0.0006), 1000, 40, 20) for i in range(2)]
    return Profile("m", "d", 1, (2, 8), layers, 16, 0.0, 0.0, 0, tp_pairs=[(0, 1)], tp_hidden=[10],
                   concurrency=concurrency, fsdp_unit=fsdp_unit)


def cpu(cores=2, ranks=2) -> Topology:
    return Topology("cpu", ranks, CostModel(0.0, 0.0, 0.0), float("inf"), "cpu", cores=cores)


def test_kappa_scales_the_compute_of_every_plan_of_several_processes_and_of_none_of_one():
    prof = profile(concurrency=1.8)
    steps = {label: price(plan, prof, cpu()).time["compute"] for label, plan in {
        "single": Plan("single", 1, 1, 16),
        "ddp": Plan("ddp", 2, 2, 16, (("allreduce", "ring"),)),
        "zero": Plan("zero", 2, 2, 16, (("zero_stage", 1),)),
        "tp": Plan("tensor-parallel", 2, 2, 16),
        "ps": Plan("ps", 2, 2, 16, (("ps_servers", 1),)),
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


def test_fsdp_pays_its_own_work_per_unit_and_zero_does_not():
    prof = profile(concurrency=1.0, fsdp_unit=0.004)
    fsdp = price(Plan("fsdp", 2, 2, 16, (("fsdp_no_reshard", True),)), prof, cpu())
    zero = price(Plan("zero", 2, 2, 16, (("zero_stage", 2),)), prof, cpu())
    assert fsdp.time["schedule overhead"] == pytest.approx(0.008)  # 2 units · 4 ms
    assert "schedule overhead" not in zero.time
    assert fsdp.step_s == pytest.approx(zero.step_s + 0.008)


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

"""The backend/device table (labkit.strategies.backends): each refused combination is one line and exit 2 before any work,
and ``--device auto`` under gloo picks the CPU for a strategy gloo cannot run on CUDA tensors. GPUs are mocked."""
import pytest
import torch
import torch.distributed as dist

from labkit.cli import main as cli_main
from labkit.dist.group import distributed
from labkit.errors import DeviceError
from labkit.strategies import backends


@pytest.mark.parametrize("strategy, options, table_key", [
    ("ps", {}, "ps:ps_mode=sync"), ("ps", {"ps_mode": "ssp"}, "ps:ps_mode=ssp"), ("zero", {"zero_stage": 3}, "zero"),
    ("ddp", {}, "ddp:allreduce=ddp"), ("ddp", {"allreduce": "native"}, "ddp:allreduce=native"),
    ("ddp", {"allreduce": "ring"}, "ddp:allreduce=ring"), ("fsdp", {}, "fsdp"), ("pipeline", {}, "pipeline"),
    ("mesh", {"mesh": "dp=2,pp=2"}, "mesh:mesh=dp=2,pp=2"), ("mesh", {}, "mesh:mesh=None")])
def test_key(strategy, options, table_key):
    assert backends.key(strategy, options) == table_key


ASYNC, RING = "ps:ps_mode=async", "ddp:allreduce=ring"


@pytest.mark.parametrize("table_key, backend, device, refused", [
    ("ddp", "nccl", "cpu", "backend nccl needs GPUs"), (ASYNC, "nccl", "cuda", "--ps-mode async receives"),
    ("ps:ps_mode=ssp", "nccl", "cuda", "--ps-mode ssp receives"), (ASYNC, "gloo", "cuda", "--strategy ps (--ps-mode async) sends"),
    ("ps:ps_mode=sync", "gloo", "cuda", "--strategy ps (--ps-mode sync) sends"),
    ("zero", "gloo", "cuda", "--strategy zero's all-gathers"), (RING, "gloo", "cuda", "labkit's --allreduce"),
    (RING, "nccl", "cuda", None), ("ddp:allreduce=native", "gloo", "cuda", None),
    ("ps:ps_mode=sync", "nccl", "cuda", None), ("ps", "nccl", "cuda", None), (ASYNC, "gloo", "cpu", None),
    ("zero", "nccl", "cuda", None), ("zero", "gloo", "cpu", None), ("ddp", "gloo", "cuda", None),
    ("fsdp", "nccl", "cuda", None), ("pipeline", "gloo", "cuda", "--strategy pipeline's stages"),
    ("pipeline", "gloo", "cpu", None), ("pipeline", "nccl", "cuda", None),
    ("mesh:mesh=dp=2,pp=2", "gloo", "cuda", "--mesh dp=2,pp=2: the pipeline's stages"),
    ("mesh:mesh=tp=2, pp = 4", "gloo", "cuda", "--mesh tp=2, pp = 4: the pipeline's stages"),
    ("mesh:mesh=pp=1,tp=2", "gloo", "cuda", None), ("mesh:mesh=cp=2", "gloo", "cuda", None),
    ("mesh:mesh=None", "gloo", "cuda", None), ("mesh:mesh=pp=", "gloo", "cuda", None),
    ("mesh:mesh=dp=2,pp=2", "gloo", "cpu", None), ("mesh:mesh=dp=2,pp=2", "nccl", "cuda", None)])
def test_table(table_key, backend, device, refused):
    why = backends.refusal(table_key, backend, device)
    assert (why is None) if refused is None else (why.startswith(refused) and "\n" not in why and "use " in why)


def test_auto_under_gloo_is_the_cpu_where_gloo_cannot_carry_cuda_tensors():
    assert backends.auto_device(ASYNC, "gloo", "auto") == "cpu"
    assert backends.auto_device("zero", "gloo", "auto") == "cpu"
    assert backends.auto_device("ddp", "gloo", "auto") == "auto"
    assert backends.auto_device("ps:ps_mode=sync", "gloo", "auto") == "cpu"
    assert backends.auto_device("zero", "nccl", "auto") == "auto"
    assert backends.auto_device("zero", "gloo", "cuda") == "cuda"  # asked for: the table refuses it instead
    assert backends.auto_device("mesh:mesh=pp=2", "gloo", "auto") == "cpu"
    assert backends.auto_device("mesh:mesh=dp=2", "gloo", "auto") == "auto"


def _gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device before the table's check"))


def test_distributed_applies_the_table_before_touching_a_gpu(monkeypatch):
    _gpus(monkeypatch)
    two = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for strategy in ("zero", "ps:ps_mode=ssp"):
        with pytest.raises(DeviceError, match="gloo"):
            with distributed(device="cuda", backend="gloo", environ=two, refusal=backends.refusal_of(strategy)):
                pass
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: started.append(kw) or pytest.skip("stop here"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    with pytest.raises(pytest.skip.Exception):
        with distributed(device=backends.auto_device(ASYNC, "gloo", "auto"), backend="gloo", environ=two,
                         refusal=backends.refusal_of(ASYNC)):
            pass
    assert started[0]["backend"] == "gloo" and started[0]["device_id"] is None  # auto became the CPU


@pytest.mark.parametrize("flags, line", [
    (["--strategy", "ps", "--ps-mode", "async", "--backend", "nccl", "--device", "cpu"], "backend nccl needs GPUs"),
    (["--strategy", "ps", "--ps-mode", "ssp", "--backend", "nccl"], "--ps-mode ssp receives pushes"),
    (["--strategy", "zero", "--backend", "gloo", "--device", "cuda"], "--strategy zero's all-gathers")])
def test_refused_combinations_are_one_line_and_exit_2(flags, line, capsys, monkeypatch):
    _gpus(monkeypatch)
    assert cli_main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"labkit: error: {line}")

"""The NCCL and multi-GPU paths (``pytest -m gpu``), each run against the same run on CPU ranks over gloo.

One GPU: two NCCL ranks on it are refused in one line; the resumed single/gpipe/model-parallel runs with K-FAC
(placement before the load, this GPU's random state). Two or more GPUs: every multi-rank strategy trains through
``labkit train`` under NCCL, writes its summary (the peak-memory all-reduce on the GPU) and matches gloo on CPU;
ZeRO resumes; gpipe and model-parallel put layers on two GPUs with K-FAC (its KL clip across devices) and resume;
the asynchronous parameter server over gloo runs on CPU tensors. Tolerances: cuDNN reassociates sums.
"""
import subprocess
import sys

import pytest
import torch

from labkit.launch.local import torchrun
from labkit.results import load_run

TWO = pytest.mark.skipif(torch.cuda.device_count() < 2,
                         reason=f"needs 2 GPUs, this node has {torch.cuda.device_count()}")
TINY = ["--dataset", "synthetic-mnist", "--train-size", "256", "--test-size", "64", "--batch-size", "16",
        "--seed", "1", "--log-every", "1000"]
STRATEGIES = {
    "ddp": ["--strategy", "ddp", "--model", "mlp"],
    "ddp-native": ["--strategy", "ddp", "--allreduce", "native", "--model", "mlp"],
    "zero-3": ["--strategy", "zero", "--zero-stage", "3", "--model", "mlp"],
    "fsdp": ["--strategy", "fsdp", "--model", "mlp"],
    "tensor-parallel": ["--strategy", "tensor-parallel", "--model", "mlp"],
    "pipeline": ["--strategy", "pipeline", "--model", "mlp", "--num-microbatches", "2"],
    "ps-sync": ["--strategy", "ps", "--ps-mode", "sync", "--model", "mlp"],
    "hybrid": ["--strategy", "hybrid", "--model", "alexnet_small", "--dataset", "synthetic-cifar10"],
    "ddp-kfac": ["--strategy", "ddp", "--model", "lenet", "--optimizer", "kfac", "--kfac-update-freq", "2"],
}


def _cli(args, out, nproc=1):
    """``labkit ARGS`` (one process) or under torchrun; returns the process (not raising)."""
    launcher = ([sys.executable, "-m", "labkit.dist.torchrun", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    return subprocess.run([*launcher, "-m", "labkit", *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=600, check=False)


def _weights(out):
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]


def _close(a, b):
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2e-3, atol=1e-5)


# ----- one GPU --------------------------------------------------------------------------------------------------

def test_two_nccl_ranks_on_one_gpu_are_refused_in_one_line(tmp_path):
    if torch.cuda.device_count() != 1:
        pytest.skip("checks a node with exactly one GPU")
    proc = _cli(["train", "--strategy", "ddp", "--model", "mlp", *TINY, "--epochs", "1", "--device", "cuda"],
                tmp_path, nproc=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("labkit: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "2 ranks on this node but 1 GPU(s) visible" in errors[0] and "NCCL_MULTI_RANK_GPU_ENABLE=1" in errors[0]


def test_gloo_ranks_on_gpus_run_their_collectives_through_the_cpu(tmp_path):
    """gloo with CUDA tensors (two ranks may share one GPU under gloo): labkit's collectives go through the CPU."""
    run = torchrun(["train", *STRATEGIES["ddp-native"], *TINY, "--epochs", "1", "--device", "cuda", "--backend",
                    "gloo", "--out", str(tmp_path)], nproc=2, echo=None)
    assert run.summary["environment"]["backend"] == "gloo" and run.summary["metrics"]["peak_memory_gb"] > 0


@pytest.mark.parametrize("strategy", [["--strategy", "single"],
                                      ["--strategy", "gpipe", "--partitions", "1", "--balance-by", "time"],
                                      ["--strategy", "model-parallel", "--mp-devices", "1", "--mp-balance-by", "time"]])
def test_resume_on_one_gpu_with_kfac_equals_the_uninterrupted_run(strategy, tmp_path):
    # --deterministic: cuDNN's default convolution backward adds with atomics, so two uninterrupted runs already
    # differ in the last digits, which K-FAC's inverses magnify to ~1e-4
    args = ["train", *strategy, "--model", "lenet", *TINY, "--device", "cuda", "--optimizer", "kfac", "--deterministic"]
    whole = _cli([*args, "--epochs", "2"], tmp_path / "whole")
    first = _cli([*args, "--epochs", "1"], tmp_path / "split")
    resumed = _cli([*args, "--epochs", "2", "--resume"], tmp_path / "split")
    for proc in (whole, first, resumed):
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    _close(_weights(tmp_path / "split"), _weights(tmp_path / "whole"))


# ----- two or more GPUs --------------------------------------------------------------------------------------------

@TWO
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_multi_rank_strategy_on_nccl_equals_gloo_on_cpu(name, tmp_path):
    args = ["train", *STRATEGIES[name], *TINY, "--epochs", "1"]
    gpu = torchrun([*args, "--device", "cuda", "--out", str(tmp_path / "nccl")], nproc=2, echo=None)
    cpu = torchrun([*args, "--device", "cpu", "--out", str(tmp_path / "gloo")], nproc=2, echo=None)
    assert gpu.summary["environment"]["backend"] == "nccl" and cpu.summary["environment"]["backend"] == "gloo"
    assert gpu.summary["metrics"]["peak_memory_gb"] > 0  # the summary exists: its all-reduce ran on the GPUs
    assert gpu.summary["metrics"]["final_train_loss"] == pytest.approx(cpu.summary["metrics"]["final_train_loss"],
                                                                       rel=2e-3)
    if (tmp_path / "nccl" / "checkpoint.pt").exists():
        _close(_weights(tmp_path / "nccl"), _weights(tmp_path / "gloo"))


@TWO
def test_zero_resumes_on_nccl_like_the_uninterrupted_run(tmp_path):
    args = ["train", *STRATEGIES["zero-3"], *TINY, "--device", "cuda"]
    whole = torchrun([*args, "--epochs", "2", "--out", str(tmp_path / "whole")], nproc=2, echo=None)
    torchrun([*args, "--epochs", "1", "--out", str(tmp_path / "split")], nproc=2, echo=None)
    resumed = torchrun([*args, "--epochs", "2", "--resume", "--out", str(tmp_path / "split")], nproc=2, echo=None)
    assert resumed.summary["metrics"]["final_train_loss"] == pytest.approx(
        whole.summary["metrics"]["final_train_loss"], rel=2e-3)


@TWO
@pytest.mark.parametrize("strategy", [["--strategy", "gpipe", "--partitions", "2", "--balance-by", "time"],
                                      ["--strategy", "model-parallel", "--mp-devices", "2", "--mp-balance-by", "time"]])
def test_layers_on_two_gpus_train_with_kfac_and_resume(strategy, tmp_path):
    """K-FAC's KL clip (on by default) sums and scales across cuda:0 and cuda:1; resume places before it loads."""
    args = ["train", *strategy, "--model", "lenet", *TINY, "--device", "cuda", "--optimizer", "kfac",
            "--kfac-update-freq", "2"]
    whole = _cli([*args, "--epochs", "2"], tmp_path / "whole")
    first = _cli([*args, "--epochs", "1"], tmp_path / "split")
    resumed = _cli([*args, "--epochs", "2", "--resume"], tmp_path / "split")
    for proc in (whole, first, resumed):
        assert proc.returncode == 0, proc.stderr[-2000:]
    _close(_weights(tmp_path / "split"), _weights(tmp_path / "whole"))
    lines = load_run(tmp_path / "whole").summary["metrics"]["memory_lines"]
    assert any(line.startswith("GPU 1:") for line in lines)  # the second partition really is on cuda:1


@TWO
def test_async_parameter_server_over_gloo_runs_on_cpu_tensors_on_a_gpu_node(tmp_path):
    run = torchrun(["train", "--strategy", "ps", "--ps-mode", "async", "--model", "mlp", *TINY, "--epochs", "1",
                    "--backend", "gloo", "--out", str(tmp_path)], nproc=2, echo=None)
    assert run.summary["environment"]["backend"] == "gloo"
    assert run.summary["environment"]["device"] == "cpu"

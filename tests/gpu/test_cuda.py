"""The CUDA and NCCL paths, each checked against the CPU or the single-device result (``pytest -m gpu``).

Skipped without a GPU (tests/gpu/conftest.py). Each test is one short run: on one H100 the layer takes about a
minute. Comparisons use float tolerances: cuDNN and TF32 reassociate sums, so CUDA and CPU agree to ~1e-3.
"""
import copy
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from labkit.data import datasets as data
from labkit.data.loader import TensorLoader
from labkit.data.tensor import tensor_dataset
from labkit.models import cnn as models
from labkit.results import load_run
from labkit.train.config import TrainConfig
from labkit.train.run import run

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda", 0)
GPU_LINE = re.compile(r"GPU 0: allocated \d+\.\d{3} GB, reserved \d+\.\d{3} GB")


@pytest.fixture(autouse=True)
def exact_matmuls():
    """Full float32 matmuls, so CUDA and CPU results are comparable at 1e-3."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _steps(model, batches, device, steps=3):
    """Plain SGD steps; returns the losses."""
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches[:steps]:
        optimizer.zero_grad()
        out = model(x.to(device))
        loss = F.cross_entropy(out, y.to(out.device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["mlp", "lenet", "resnet20", "resnet32", "resnet50", "alexnet_small"])
def test_single_device_trains_every_model_on_cuda_like_on_cpu(name, tmp_path):
    dataset = "synthetic-cifar10" if name == "alexnet_small" else "synthetic-mnist"
    info = data.dataset_info(dataset)
    batches = list(TensorLoader(tensor_dataset(dataset, size=96), 32, shuffle=False))
    torch.manual_seed(0)
    # training mode, as fit runs it: in eval mode (running stats 0 and 1) resnet32's unnormalised residual sums
    # start at a loss of 22.8 and reach NaN by the third step on both devices, which compares nothing
    model = models.get_model(name, info.num_classes, info.in_channels, info.image_size).train()
    cpu, gpu = _steps(copy.deepcopy(model), batches, "cpu"), _steps(copy.deepcopy(model), batches, CUDA)
    assert all(math.isfinite(loss) for loss in cpu) and gpu == pytest.approx(cpu, rel=2e-3)
    summary = run(TrainConfig(model=name, dataset=dataset, device="cuda", epochs=1, max_steps=4, train_size=256,
                              test_size=128, batch_size=32, out=str(tmp_path)))
    assert summary["metrics"]["samples_per_sec"] > 0 and summary["metrics"]["peak_memory_gb"] > 0
    assert GPU_LINE.fullmatch(summary["metrics"]["memory_lines"][0])


def test_gpipe_on_cuda0_twice_equals_the_unpartitioned_model():
    from labkit.strategies.gpipe import make_gpipe

    batches = list(TensorLoader(tensor_dataset("synthetic-mnist", size=64), 32, shuffle=False))
    torch.manual_seed(0)
    model = models.get_model("lenet", sequential=True)
    reference = _steps(copy.deepcopy(model), batches, CUDA, steps=2)
    gpipe = make_gpipe(copy.deepcopy(model), [CUDA, CUDA], chunks=4, checkpoint="never", balance=[5, 7])
    optimizer = torch.optim.SGD(gpipe.parameters(), lr=0.05)
    losses = []
    for x, y in batches[:2]:
        optimizer.zero_grad()
        loss = F.cross_entropy(gpipe(x.to(CUDA)), y.to(CUDA))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses == pytest.approx(reference, rel=1e-4)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kfac_on_cuda_preconditions_like_on_cpu(method):
    from labkit.optim.kfac.preconditioner import KFAC

    x, y = tensor_dataset("synthetic-mnist", size=64).batch(torch.arange(64))
    torch.manual_seed(0)
    template = models.get_model("lenet")
    grads = {}
    for device in ("cpu", CUDA):
        model = copy.deepcopy(template).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        kfac = KFAC(model, method=method, optimizer=optimizer)
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        kfac.step()
        grads[str(device)] = [p.grad.double().cpu() for p in model.parameters()]
    for a, b in zip(grads["cpu"], grads["cuda:0"]):
        torch.testing.assert_close(b, a, rtol=2e-3, atol=1e-5)


def test_model_parallel_with_both_stages_on_one_gpu_equals_one_device():
    from labkit.strategies.model_parallel import ModelParallel

    batches = list(TensorLoader(tensor_dataset("synthetic-mnist", size=64), 32, shuffle=False))
    torch.manual_seed(0)
    model = models.get_model("lenet", sequential=True)
    reference = _steps(copy.deepcopy(model), batches, CUDA)
    for split in (None, 8):
        split_model = ModelParallel(copy.deepcopy(model), [CUDA, CUDA], "params", split)
        assert _steps(split_model, batches, CUDA) == pytest.approx(reference, rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_allreduce_algorithms_verify_on_nccl():
    """labkit's own all-reduce schedules against dist.all_reduce on two GPUs (strategies: test_multi_gpu.py)."""
    verify = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "labkit", "allreduce", "verify", "--device", "cuda"], capture_output=True,
                            text=True, timeout=300, check=False)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]


@pytest.mark.parametrize("script, extra", [("mnist_pytorch.py", []),
                                           ("mnist_gpipe_answer.py", ["--devices", "cuda:0", "cuda:0"])])
def test_hands_on_scripts_run_on_the_gpu_and_print_the_seed_lines(script, extra, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "gpipe" / script), "--dataset", "mnist-sample",
                           "--max_steps", "5", "--batchsize", "64", "--out", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"train \| epoch 1/1 \(\d+%\) \| [\d.]+ samples/sec$", proc.stdout, re.M)
    assert GPU_LINE.search(proc.stdout)


def test_profile_records_cuda_kernels(tmp_path):
    run(TrainConfig(model="lenet", dataset="synthetic-mnist", device="cuda", max_steps=8, train_size=512,
                    test_size=64, profile=True, out=str(tmp_path)))
    traces = list((tmp_path / "profile").glob("*.json*"))
    assert traces
    text = traces[0].read_bytes()
    if traces[0].suffix == ".gz":
        import gzip
        text = gzip.decompress(text)
    assert b'"cat": "kernel"' in text or b'"cat":"kernel"' in text  # CUDA kernels, not only CPU ops


def test_resident_data_path_on_cuda_equals_cpu_and_augments_on_the_gpu(tmp_path):
    cpu, gpu = tensor_dataset("mnist-sample"), tensor_dataset("mnist-sample", device="cuda")
    assert gpu.device.type == "cuda"
    for (xc, yc), (xg, yg) in zip(TensorLoader(cpu, 256, True, seed=2), TensorLoader(gpu, 256, True, seed=2)):
        assert xg.device.type == "cuda" and torch.equal(yg.cpu(), yc)
        torch.testing.assert_close(xg.cpu(), xc, rtol=1e-6, atol=1e-6)  # normalised on the GPU
    augmented = tensor_dataset("synthetic-cifar10", augment=True, device="cuda", size=64)
    x, _ = augmented.batch(torch.arange(64, device="cuda"))
    assert x.device.type == "cuda" and x.shape == (64, 3, 32, 32)
    from labkit.cli import main

    assert main(["bench", "datapath", "--device", "cuda", "--steps", "5", "--rounds", "2", "--out",
                 str(tmp_path / "dp")]) == 0
    metrics = load_run(tmp_path / "dp").summary["metrics"]
    assert {"torch loader", "tensor loader", "model only"} <= set(metrics)

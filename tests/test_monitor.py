"""Utilisation sampling: the CPU % it reports is this process's CPU time per wall second, as top shows it."""
import sys
import time
import types

import pytest
import torch

from labkit.monitor import UtilisationMonitor, nvml_indices


def test_cpu_percent_equals_the_process_cpu_time_per_wall_second():
    a = torch.randn(300, 300)
    wall, cpu = time.perf_counter(), time.process_time()
    with UtilisationMonitor(interval_s=0.1) as busy:
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:
            a @ a
    expected = 100 * (time.process_time() - cpu) / (time.perf_counter() - wall)
    summary = busy.summary()
    assert len(busy.samples) >= 4 and all(s["kind"] == "utilisation" and s["gpu"] == [] for s in busy.samples)
    assert summary["cpu_percent_mean"] == pytest.approx(expected, abs=15)
    with UtilisationMonitor(interval_s=0.1) as idle:
        time.sleep(0.4)
    assert idle.summary()["cpu_percent_mean"] < summary["cpu_percent_mean"]


def test_gpu_indices_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert nvml_indices([torch.device("cuda", 1), torch.device("cpu")]) == [5]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_indices(["cuda:0", "cuda:2"]) == [0, 2] and nvml_indices(["cpu"]) == []
    with pytest.raises(ValueError, match="interval_s"):
        UtilisationMonitor(interval_s=0)


def test_gpu_names_follow_uuids_and_mig_ids_or_are_left_out(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa11,MIG-bb22,MIG-GPU-cc33/1/0")
    assert nvml_indices(["cuda:0", "cuda:1", "cuda:2", "cuda:3"]) == ["GPU-aa11", "MIG-bb22"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvml_indices(["cuda:0"]) == []


class _FakeNVML:
    """NVML with GPU 0 and GPU-aa11 working, index 7 unknown, and MIG-bb22 answering memory but not utilisation."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.shutdown = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdown += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        if index == 7:
            raise self.NVMLError("Invalid Argument")
        return f"h{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return f"h{uuid}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle == "hMIG-bb22":
            raise self.NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=2 * 1024 ** 3)


def test_an_nvml_error_leaves_that_gpu_out_and_never_stops_the_run(monkeypatch):
    nvml = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with UtilisationMonitor(interval_s=0.05, gpus=[7, 0, "GPU-aa11", "MIG-bb22"]) as monitor:
        time.sleep(0.15)
    assert monitor.samples and all(
        s["gpu"] == [{"index": 0, "util_percent": 40.0, "memory_gb": 2.0},
                     {"index": "GPU-aa11", "util_percent": 40.0, "memory_gb": 2.0}] for s in monitor.samples)
    assert monitor.summary()["gpu_util_percent_mean"] == 40.0 and nvml.shutdown == 1

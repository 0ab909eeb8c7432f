"""Utilisation sampling: the CPU % it reports is this process's CPU time per wall second, as top shows it."""
import sys
import time
import types

import pytest
import torch

from labkit.train import monitor
from labkit.train.monitor import UtilisationMonitor, nvml_indices


class _FakeProcess:
    """psutil.Process with scripted CPU percentages (the first call only starts psutil's interval)."""

    def __init__(self, pid):
        self.percents = iter([0.0, 200.0, 50.0, 100.0])

    def cpu_percent(self, interval):
        return next(self.percents)


def test_cpu_percent_mean_weights_each_sample_by_the_wall_time_it_covers(monkeypatch):
    """A fake clock and scripted psutil readings: 200 % over 1 s, 50 % over 2 s, 100 % over the last 1 s."""
    clock = [10.0]
    monkeypatch.setattr(monitor.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(monitor.psutil, "Process", _FakeProcess)
    with UtilisationMonitor(interval_s=3600) as watched:  # the thread never ticks: samples are taken here
        for seconds in (1.0, 2.0):
            clock[0] += seconds
            watched._take()
        clock[0] += 1.0
    assert [(s["t_s"], s["cpu_percent"], s["gpu"]) for s in watched.samples] == [
        (1.0, 200.0, []), (3.0, 50.0, []), (4.0, 100.0, [])]
    assert watched.summary()["cpu_percent_mean"] == (200.0 * 1 + 50.0 * 2 + 100.0 * 1) / 4


def test_the_thread_samples_this_process_until_the_block_ends():
    """The real thread and psutil: samples arrive while the block runs (waited for, not timed), and stop with it."""
    a = torch.randn(200, 200)
    with UtilisationMonitor(interval_s=0.01) as busy:
        deadline = time.monotonic() + 60
        while len(busy.samples) < 3 and time.monotonic() < deadline:
            a @ a
    taken = len(busy.samples)
    assert taken >= 3 + 1 and all(s["kind"] == "utilisation" and s["cpu_percent"] >= 0 for s in busy.samples)
    assert busy.samples == sorted(busy.samples, key=lambda s: s["t_s"]) and busy.summary()["cpu_percent_mean"] >= 0
    assert len(busy.samples) == taken and not busy._thread.is_alive()  # joined: nothing samples any more


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

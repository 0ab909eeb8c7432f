"""Utilisation sampling: the CPU % it reports is this process's CPU time per wall second, as top shows it."""
import time

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

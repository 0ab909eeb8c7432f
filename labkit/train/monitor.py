"""Utilisation while training: is the processor busy? (Seed 004: watch ``top`` / ``nvidia-smi`` and raise
the batch size until it is.)

A background thread samples, every ``interval_s`` seconds,

* ``cpu_percent``: CPU time of this process (all its threads) per wall second, in % of one core, as ``top``
  shows it (200 % = two cores busy), from psutil;
* ``gpu_util_percent`` and ``gpu_memory_gb`` of each GPU this process uses, from NVIDIA's NVML binding
  (``nvidia-ml-py``), where an NVIDIA driver is present.

    with UtilisationMonitor() as monitor:
        fit(...)
    monitor.samples      # [{"kind": "utilisation", "t_s": 0.5, "cpu_percent": 187.0, "gpu": [...]}, ...]
    monitor.summary()    # {"cpu_percent_mean": ..., "gpu_util_percent_mean": ..., ...}
"""
from __future__ import annotations

import os
import threading
import time
from statistics import mean

import psutil

GB = 1024 ** 3


class _Gpus:
    """NVML handles of the GPUs in ``gpus`` (physical indices or UUIDs); empty where there is no NVIDIA driver.

    Utilisation is a side line: an NVML error (no driver, a GPU it cannot open, a query a MIG slice does not
    answer) leaves that GPU out of the samples and never stops the run.
    """

    def __init__(self, gpus: list[int | str]):
        self.handles = []
        self.started = False
        if not gpus:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no driver or no binding: a CPU node, nothing to sample
            return
        self.nvml, self.started = pynvml, True
        for gpu in gpus:
            try:
                handle = (pynvml.nvmlDeviceGetHandleByUUID(gpu) if isinstance(gpu, str)
                          else pynvml.nvmlDeviceGetHandleByIndex(gpu))
            except Exception:  # a GPU NVML cannot open: not sampled
                continue
            self.handles.append((gpu, handle))

    def sample(self) -> list[dict]:
        out = []
        for gpu, handle in self.handles:
            try:
                util = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:  # e.g. utilisation on a MIG slice: not sampled
                continue
            out.append({"index": gpu, "util_percent": float(util.gpu), "memory_gb": memory.used / GB})
        return out

    def close(self) -> None:
        if self.started:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass


class UtilisationMonitor:
    """Sample this process's CPU use (and its GPUs') in a background thread while a block runs.

    Args:
        interval_s: seconds between samples.
        gpus: GPUs to sample, as NVML knows them: physical indices or UUIDs (:func:`nvml_indices`); none on a
            CPU run.
    """

    def __init__(self, interval_s: float = 0.5, gpus: list[int] | None = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.gpu_indices = list(gpus or [])
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "UtilisationMonitor":
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)  # the first call starts psutil's interval
        self._gpus = _Gpus(self.gpu_indices)
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="labkit-utilisation", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()  # the tail since the last tick
        self._gpus.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def _take(self) -> None:
        self.samples.append({"kind": "utilisation", "t_s": time.perf_counter() - self._start,
                             "cpu_percent": self._process.cpu_percent(None), "gpu": self._gpus.sample()})

    def summary(self) -> dict:
        """``cpu_percent_mean`` (weighted by the time each sample covers), ``cpu_cores`` and, with GPUs,
        ``gpu_util_percent_mean`` and ``gpu_memory_gb_max``."""
        if not self.samples:
            return {}
        ends = [s["t_s"] for s in self.samples]
        weights = [b - a for a, b in zip([0.0] + ends[:-1], ends)]  # each sample covers the time since the last
        busy = sum(w * s["cpu_percent"] for w, s in zip(weights, self.samples)) / max(sum(weights), 1e-9)
        out = {"cpu_percent_mean": busy, "cpu_cores": psutil.cpu_count()}
        gpu = [g for s in self.samples for g in s["gpu"]]
        if gpu:
            out["gpu_util_percent_mean"] = mean(g["util_percent"] for g in gpu)
            out["gpu_memory_gb_max"] = max(g["memory_gb"] for g in gpu)
        return out


def nvml_indices(devices) -> list[int | str]:
    """How NVML names the CUDA devices among ``devices``: through ``CUDA_VISIBLE_DEVICES``, a physical index or a
    UUID (``GPU-…``, or ``MIG-…`` for a MIG slice); a device listed in a form NVML cannot look up (the older
    ``MIG-GPU-…/gi/ci``) is left out rather than sampled as the wrong GPU."""
    import torch

    local = sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    out: list[int | str] = []
    for i in local:
        if i >= len(ids):
            continue
        if ids[i].isdigit():
            out.append(int(ids[i]))
        elif ids[i].startswith(("GPU-", "MIG-")) and "/" not in ids[i]:
            out.append(ids[i])
    return out


def gather(monitor: UtilisationMonitor, env, writer=None) -> dict:
    """Every rank's samples (with its ``rank``) logged by ``writer`` on rank 0; returns the job's summary:
    ``cpu_percent_mean`` per rank and, with GPUs, ``gpu_util_percent_mean`` per rank."""
    import torch.distributed as dist

    mine = [{**s, "rank": env.rank} for s in monitor.samples]
    per_rank = [mine]
    summaries = [monitor.summary()]
    if env.distributed:
        per_rank, summaries = [None] * env.world_size, [None] * env.world_size
        dist.all_gather_object(per_rank, mine)
        dist.all_gather_object(summaries, monitor.summary())
    if writer is not None:
        for samples in per_rank:
            for sample in samples:
                writer.log(sample)
    out = {"cpu_percent_mean": [s.get("cpu_percent_mean") for s in summaries]}
    if any("gpu_util_percent_mean" in s for s in summaries):
        out["gpu_util_percent_mean"] = [s.get("gpu_util_percent_mean") for s in summaries]
        out["gpu_memory_gb_max"] = [s.get("gpu_memory_gb_max") for s in summaries]
    return out

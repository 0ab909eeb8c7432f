"""The device's peak FLOP/s, and a run's model and hardware FLOPs utilisation (MFU, HFU) against it.

    peak = device_peak(torch.device("cuda"), amp="bf16")   # NVIDIA H100 SXM: 989 TFLOP/s bf16, from the datasheet
    peak = device_peak(torch.device("cpu"))                # this CPU's fp32 matmul at this thread count, measured
    FlopUtilisation(model_per_sample, hardware_per_sample, peak, devices=4).of(samples_per_sec)  # {"mfu", "hfu", ...}

``MFU = model FLOPs per sample × samples/s ÷ (devices × peak)`` (PaLM's appendix B), with the model FLOPs of a
step counted without recompute (:mod:`labkit.train.flops`); ``HFU`` is the same with the FLOPs the hardware
really runs, recomputed forward passes included, so HFU ≥ MFU, equal without activation checkpointing. samples/s
is the job's (all data-parallel ranks), so the denominator holds every device of the job.

**The peak.** A GPU whose name :data:`GPU_PEAKS` knows: its datasheet's dense figure (no 2:4 sparsity) for the
run's precision: ``bf16`` under ``--amp bf16``; in float32, ``tf32`` where PyTorch lets the tensor cores round
to TF32 (convolutions: ``torch.backends.cudnn.allow_tf32``, on by default; matrix products:
``torch.get_float32_matmul_precision() != "highest"``, off by default), else ``fp32``. A CPU, or a GPU the table
lacks: the best of a few ``n × n`` matrix products in the run's dtype, ``2·n³ / seconds``, measured once per
device name, thread count, dtype and torch version and cached in ``$LABKIT_CACHE/peak_flops.json`` (default
folder ``$XDG_CACHE_HOME/labkit``, else ``~/.cache/labkit``: :func:`cache_folder`); delete the file to measure again (a peak measured while
the machine was busy is low, and every MFU read against it high).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.results import atomic_write_text

TERA = 1e12

#: (substrings the CUDA device name must contain, row name, dense TFLOP/s by precision); first match wins, so the
#: more specific names come first. Each row's source is named beside it.
GPU_PEAKS: list[tuple[tuple[str, ...], str, dict[str, float]]] = [
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 NVL column; sparse figures halved
    (("H200", "NVL"), "NVIDIA H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column; sparse figures halved
    (("H200",), "NVIDIA H200 SXM", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the H100 SXM's compute
    (("GH200",), "NVIDIA GH200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 NVL column; sparse figures halved
    (("H100", "NVL"), "NVIDIA H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    # NVIDIA H100 Tensor Core GPU datasheet (2022), H100 PCIe column; sparse figures halved
    (("H100", "PCIe"), "NVIDIA H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column; sparse figures halved
    (("H100",), "NVIDIA H100 SXM", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # NVIDIA A100 Tensor Core GPU datasheet (2021), SXM and PCIe alike; dense
    (("A100",), "NVIDIA A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    # NVIDIA A10 Tensor Core GPU datasheet (2021); sparse figures halved
    (("A10",), "NVIDIA A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    # NVIDIA L40S GPU datasheet (2023); sparse figures halved
    (("L40S",), "NVIDIA L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    # NVIDIA L4 Tensor Core GPU datasheet (2023); sparse figures halved
    (("L4",), "NVIDIA L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # NVIDIA V100 Tensor Core GPU datasheet (2020), SXM2 column: fp16 tensor cores, no bf16 or tf32
    (("V100", "SXM2"), "NVIDIA V100 SXM2", {"fp16": 125.0, "fp32": 15.7}),
    # NVIDIA V100 Tensor Core GPU datasheet (2020), PCIe column
    (("V100",), "NVIDIA V100 PCIe", {"fp16": 112.0, "fp32": 14.0}),
    # NVIDIA T4 Tensor Core GPU datasheet (2019): fp16 tensor cores, no bf16 or tf32
    (("T4",), "NVIDIA T4", {"fp16": 65.0, "fp32": 8.1}),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class Peak:
    """A device's peak: FLOP/s per device at ``precision``, and where the figure comes from."""

    flops_per_s: float
    precision: str
    source: str

    def describe(self) -> str:
        """``989 TFLOP/s bf16 (NVIDIA H200 SXM datasheet, dense)``."""
        return f"{flops_text(self.flops_per_s)}/s {self.precision} ({self.source})"


def flops_text(flops: float) -> str:
    """``flops`` with an SI prefix, three significant figures: 1.52e6 -> ``1.52 MFLOP``."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if flops >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP"
    return f"{flops:.3g} FLOP"


def precision(device: torch.device, amp: str | None, convolutional: bool = False) -> str:
    """The precision the run's matrix products run at (module docstring): ``bf16``, ``tf32`` or ``fp32``."""
    if amp is not None:
        return amp
    if torch.device(device).type != "cuda":
        return "fp32"
    tf32 = (torch.backends.cudnn.allow_tf32 if convolutional
            else torch.get_float32_matmul_precision() != "highest")
    return "tf32" if tf32 else "fp32"


def gpu_peak(name: str, precision: str) -> Peak | None:
    """The datasheet peak of the GPU called ``name`` (``torch.cuda.get_device_name``) at ``precision``, or None
    when :data:`GPU_PEAKS` has no row or no figure for it."""
    for needles, row, figures in GPU_PEAKS:
        if all(n.lower() in name.lower() for n in needles):
            if precision not in figures:
                return None
            return Peak(figures[precision] * TERA, precision, f"{row} datasheet, dense")
    return None


def cache_folder() -> Path:
    """``$LABKIT_CACHE``; default ``$XDG_CACHE_HOME/labkit``, else ``~/.cache/labkit``: the measured peaks
    (``peak_flops.json``) and the counted FLOPs of each model and shape (``flops.json``, :mod:`labkit.train.flops`)."""
    return Path(os.environ.get("LABKIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "labkit")


def cache_file() -> Path:
    """``peak_flops.json`` in :func:`cache_folder`."""
    return cache_folder() / "peak_flops.json"


def read_table(file: Path) -> dict:
    """The JSON object in ``file``; an empty one if it is missing or unreadable."""
    try:
        table = json.loads(Path(file).read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def store_entry(file: Path, key: str, entry: dict) -> str:
    """Add ``key: entry`` to the table in ``file`` (written atomically); ``cached in FILE``, or why not."""
    table = read_table(file)
    table[key] = entry
    try:
        atomic_write_text(file, json.dumps(table, indent=2) + "\n")
    except OSError:
        return f"not cached: {file} is not writable"
    return f"cached in {file}"


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """The best FLOP/s of ``repeats`` products of two ``n × n`` matrices of ``dtype`` on ``device`` (after one
    unmeasured one): ``2·n³ / seconds``."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    best = float("inf")
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU's model name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def measured_peak(device: torch.device, precision: str, cache: Path | None = None, n: int = 1024) -> Peak:
    """The matmul peak of ``device`` at ``precision`` (on a CPU at ``torch.get_num_threads()`` threads), from the
    cache file if it holds one for this device, thread count, dtype and torch version, else measured and written
    there (an unwritable cache is skipped: the figure is measured again next time)."""
    cache = cache or cache_file()
    device = torch.device(device)
    threads = torch.get_num_threads()
    where = f"{threads} thread{'s' * (threads != 1)}" if device.type == "cpu" else "one device"
    key = f"{device_name(device)} | {where} | {precision} | torch {torch.__version__}"
    entry = read_table(cache).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), (int, float)):
        return Peak(float(entry["flops_per_s"]), precision, f"{n}x{n} matmul measured at {where}, cached in {cache}")
    if precision == "tf32" and device.type == "cuda":
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
    try:
        flops = measure_matmul(device, DTYPES[precision], n)
    finally:
        if precision == "tf32" and device.type == "cuda":
            torch.set_float32_matmul_precision(before)
    stored = store_entry(cache, key, {"flops_per_s": flops, "n": n,
                                      "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return Peak(flops, precision, f"{n}x{n} matmul measured at {where}, {stored}")


def device_peak(device: torch.device, amp: str | None = None, convolutional: bool = False,
                cache: Path | None = None) -> Peak:
    """The peak FLOP/s of one ``device`` for a run with ``amp``: the datasheet's for a known GPU, else measured
    (:func:`measured_peak`)."""
    device = torch.device(device)
    prec = precision(device, amp, convolutional)
    if device.type == "cuda":
        known = gpu_peak(device_name(device), prec)
        if known is not None:
            return known
    return measured_peak(device, prec, cache)


@dataclass(frozen=True)
class FlopUtilisation:
    """MFU and HFU of a run from its samples/s: ``model_per_sample`` and ``hardware_per_sample`` FLOPs per sample
    of a step (without and with recompute), ``peak`` per device, ``devices`` in the job."""

    model_per_sample: int
    hardware_per_sample: int
    peak: Peak
    devices: int = 1

    def of(self, samples_per_sec: float) -> dict:
        """``{"mfu", "hfu", "model_flops_per_s"}`` at ``samples_per_sec`` (the job's)."""
        achieved = self.model_per_sample * samples_per_sec                       # model FLOP/s of the job
        capacity = self.devices * self.peak.flops_per_s
        return {"mfu": achieved / capacity, "hfu": self.hardware_per_sample * samples_per_sec / capacity,
                "model_flops_per_s": achieved}

    def text(self, samples_per_sec: float) -> str:
        """``MFU 3.41%, HFU 3.41%`` (three significant figures)."""
        u = self.of(samples_per_sec)
        return f"MFU {100 * u['mfu']:.3g}%, HFU {100 * u['hfu']:.3g}%"

    def as_dict(self) -> dict:
        return {"peak_flops_per_s": self.peak.flops_per_s, "peak_precision": self.peak.precision,
                "peak_source": self.peak.source, "devices": self.devices}

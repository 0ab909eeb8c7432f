"""Throughput and memory meters that print the lines learners compare across strategies (seed 003)::

    train | epoch 1/1 (4%) | 692 samples/sec (estimated)
    train | epoch 1/1 (100%) | 718 samples/sec
    GPU 0: allocated 0.271 GB, reserved 8.072 GB

"allocated" is what live tensors hold (parameters, optimizer state) when training ends; "reserved" is what
PyTorch's caching allocator kept, which is driven by the activations at the peak. On CPU the kit prints
the process's resident memory at the end and its peak (the kernel's high-water mark of the same resident set,
so the peak is never below the resident figure) instead, labelled as such. Rates are printed to three
significant figures (``rate_text``): a rate measured on a shared machine is not known to more.
"""
from __future__ import annotations

import math
import os
import resource
import sys
import time
from typing import Callable, Iterable

import torch

GB = 1024 ** 3


def rate_text(rate: float) -> str:
    """``rate`` to three significant figures, never in exponent form: 692.34 -> ``692``, 9.088 -> ``9.09``,
    71 880.2 -> ``71880``."""
    if rate <= 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(rate)))
    return f"{rate:.{decimals}f}"


def throughput_line(epoch: int, epochs: int, done: int, steps: int, samples_per_sec: float,
                    estimated: bool, tokens_per_sec: float | None = None) -> str:
    """``train | epoch {epoch}/{epochs} ({percent}%) | {rate} samples/sec[, {tokens} tokens/sec][ (estimated)]``.

    ``percent = 100 * done // steps`` with ``done`` the steps finished, so a whole epoch ends at 100%.
    ``tokens_per_sec`` (language models) is shown beside the samples (sequences) per second.
    """
    percent = 100 * done // max(steps, 1)
    line = f"train | epoch {epoch}/{epochs} ({percent}%) | {rate_text(samples_per_sec)} samples/sec"
    if tokens_per_sec is not None:
        line += f", {rate_text(tokens_per_sec)} tokens/sec"
    return line + " (estimated)" if estimated else line


def memory_lines(devices: Iterable[torch.device]) -> list[str]:
    """One line per GPU (``GPU i: allocated X GB, reserved Y GB``), or one CPU process line."""
    lines = []
    for device in dict.fromkeys(torch.device(d) for d in devices):
        if device.type == "cuda":
            i = device.index if device.index is not None else torch.cuda.current_device()
            lines.append(f"GPU {i}: allocated {torch.cuda.memory_allocated(i) / GB:.3f} GB, "
                         f"reserved {torch.cuda.memory_reserved(i) / GB:.3f} GB")
    if not lines:
        rss, peak = process_memory_gb()
        lines.append(f"CPU (process, all devices): resident {rss:.3f} GB, peak {peak:.3f} GB")
    return lines


def process_memory_gb() -> tuple[float, float]:
    """(resident set size now, its peak so far) of this process in GB.

    Both from one read of ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the kernel's counter and its high-water
    mark, which the kernel raises to the current value as it reports them, so peak >= resident); where that file
    is missing, ``getrusage``'s peak for both.
    """
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        rss, peak = (int(fields[key].split()[0]) * 1024 / GB for key in ("VmRSS", "VmHWM"))  # in kB
    except (OSError, KeyError, ValueError):
        rss = peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # KiB on Linux
    return rss, max(peak, rss)


def peak_memory_gb(devices: Iterable[torch.device]) -> float:
    """Largest peak allocation over the GPUs in ``devices``, else the process peak RSS."""
    gpus = [torch.device(d) for d in devices if torch.device(d).type == "cuda"]
    if gpus:
        return max(torch.cuda.max_memory_allocated(d) for d in gpus) / GB
    return process_memory_gb()[1]


def interactive() -> bool:
    """True in a terminal (show a live progress bar), False in notebooks and batch jobs (print plain lines).

    A notebook keeps its outputs: a bar would be saved half-drawn next to the throughput lines, which already
    say how far the epoch is.
    """
    if os.environ.get("LABKIT_PLAIN") == "1" or os.environ.get("SLURM_JOB_ID") or "ipykernel" in sys.modules:
        return False
    return sys.stderr.isatty()


class ThroughputMeter:
    """Counts samples over one epoch and reports samples/sec, skipping the first ``warmup`` steps.

    Two steps by default: the first pays allocator growth and first-call costs, and the second still differs
    from the rest (DDP rebuilds its gradient buckets in the order the first backward produced them). An epoch
    too short to spare them (``steps - first <= 2 warmup + 1``) is timed whole; :attr:`timed_steps` says what
    counted. An epoch resumed from a mid-epoch checkpoint starts at step ``first``: the percentage counts the
    epoch's steps done, ``(first + steps run) / steps``, and the rate only the steps this process ran.

    The rate's window is bounded the way benchmarks bound it: at its start (after the warm-up) and at its end
    (:meth:`finish`) the device's queue is drained and, with ``barrier``, every rank meets, so the window holds
    the slowest rank's steps, not rank 0's alone. :attr:`window_s` is its length. The ``(estimated)`` lines
    read this rank's clock without a barrier.

    Args:
        epoch, epochs: shown as ``epoch/epochs`` (1-based epoch).
        steps: batches in this epoch.
        first: steps of this epoch done before this meter started (a resumed run).
        every: print an ``(estimated)`` line every this many steps (plain mode).
        warmup: steps excluded from the rate.
        printer: where lines go (``print`` on rank 0 by default).
        world_factor: data-parallel ranks (the rate is per job).
        device: a CUDA device is synchronised before reading the clock, so queued kernels are counted.
        estimate_printer: where the ``(estimated)`` lines go instead, e.g. a progress bar's postfix, so
            a terminal shows one progress display.
        barrier: called by every rank at both ends of the window (e.g. ``torch.distributed.barrier``).
        tokens: also report tokens/sec (language models: :meth:`update` says how many tokens a sample holds).
    """

    def __init__(self, epoch: int, epochs: int, steps: int, every: int = 20, warmup: int = 2,
                 printer: Callable[[str], None] = print, world_factor: int = 1, device: torch.device | None = None,
                 estimate_printer: Callable[[str], None] | None = None, first: int = 0,
                 barrier: Callable[[], None] | None = None, tokens: bool = False):
        self.epoch, self.epochs, self.steps, self.first = epoch, epochs, steps, first
        self.every, self.printer = max(1, every), printer
        self.estimate_printer = estimate_printer or printer
        self.warmup = warmup if steps - first > 2 * warmup + 1 else 0
        self.world_factor = world_factor
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.device, self.barrier = device, barrier
        self.samples = 0
        self.tokens, self.tokens_per_sample = tokens, 1
        self.step = -1
        self.window_s = 0.0
        self.last_rate = 0.0
        self.start = self._mark() if self.warmup == 0 else time.perf_counter()

    @property
    def timed_steps(self) -> int:
        """Steps whose time the rate counts (all steps so far minus the warm-up)."""
        return max(self.step + 1 - self.warmup, 0)

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _mark(self) -> float:
        """The clock once the device's queue is empty and every rank got here."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.barrier is not None:
            self.barrier()
        return time.perf_counter()

    def update(self, batch_size: int, tokens_per_sample: int = 1) -> None:
        """Call after each optimizer step with this rank's batch size (and, for a language model, the tokens of
        one sequence)."""
        self.step += 1
        self.tokens_per_sample = tokens_per_sample
        self.samples += batch_size
        if self.step < self.warmup:  # no estimate from warm-up steps
            if self.step + 1 == self.warmup:
                self.start, self.samples = self._mark(), 0
            return
        done = self.first + self.step + 1
        if self.step % self.every == 0 and done < self.steps:
            rate = self.rate
            self.estimate_printer(throughput_line(self.epoch, self.epochs, done, self.steps, rate, True,
                                                  self._tokens(rate)))

    @property
    def rate(self) -> float:
        """Samples per second over the whole job (per-rank rate × data-parallel ranks)."""
        if self.samples == 0:
            return 0.0
        return self.world_factor * self.samples / max(self._now() - self.start, 1e-9)

    def _tokens(self, samples_per_sec: float) -> float | None:
        return samples_per_sec * self.tokens_per_sample if self.tokens else None

    @property
    def tokens_per_sec(self) -> float:
        """Tokens per second of the closed window (after :meth:`finish`; language models)."""
        return self._tokens(self.last_rate) or 0.0

    def finish(self) -> float:
        """Close the window (every rank calls this), print the end-of-epoch line and return samples/sec."""
        self.window_s = max(self._mark() - self.start, 1e-9)
        rate = self.world_factor * self.samples / self.window_s if self.samples else 0.0
        self.last_rate = rate
        self.printer(throughput_line(self.epoch, self.epochs, self.first + self.step + 1, self.steps, rate, False,
                                     self._tokens(rate)))
        return rate

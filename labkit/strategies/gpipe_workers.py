"""torchgpipe on CPU: labkit's pipelines run each task on the calling thread instead of a worker thread
started per mini-batch; every other torchgpipe pipeline keeps torchgpipe's own workers.

torchgpipe hands each partition's forward tasks to a worker thread per device, and starts those threads anew
in every forward call (``torchgpipe.pipeline.spawn_workers``). Partitions on one device share one worker, so
on a CPU (``devices = P × cpu``) the tasks already run one after another, in the order they are queued, while
the calling thread waits. What the thread adds there is cost: the first operators a new thread runs pay for
its own OpenMP team and oneDNN state, every mini-batch again, and afterwards its team and the caller's (which
runs backward) spin on the same cores. Measured on 2 cores, one forward of 32 samples (median of 30): LeNet
1.34 ms on the calling thread, 5.67 ms on a fresh thread; ResNet-20 50.5 / 79.2 ms. GPipe on CPU was 1.3–2.2×
slower than the same micro-batches run plainly; a worker kept alive between mini-batches was slower still on
LeNet (the two teams' spinning).

:class:`InlineGPipe` is the ``torchgpipe.GPipe`` that :func:`labkit.strategies.gpipe.make_gpipe` builds. Its
forward runs torchgpipe's own, inside :func:`inline_tasks`: for that call ``torchgpipe.pipeline.spawn_workers``
is :func:`_workers`, which, for an all-CPU pipeline and the thread that opened the context, gives the pipeline
queues whose ``put`` runs the task at once — what torchgpipe's ``worker`` loop does with it: ``task.compute()``,
and ``(True, (task, batch))`` or ``(False, exc_info)`` handed back in order. Outside labkit's forward calls
``torchgpipe.pipeline.spawn_workers`` is torchgpipe's again, so a plain ``torchgpipe.GPipe`` in the same
process runs on worker threads as torchgpipe made it (which also matters for autocast, a per-thread state:
torchgpipe's workers do not see the caller's). The schedule, the micro-batches, checkpointing and
recomputation are torchgpipe's, unchanged (the GPipe tests compare them with plain training and with
torchgpipe's workers). A pipeline with any GPU keeps torchgpipe's worker threads, which let its devices
compute at the same time.
"""
from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torchgpipe.pipeline
from torchgpipe import GPipe
from torchgpipe.worker import spawn_workers


class InlineWorker:
    """A worker's in-queue and out-queue in one: ``put(task)`` computes it now, ``get()`` returns the results in
    the order the tasks were put (the protocol of ``torchgpipe.worker.worker``)."""

    def __init__(self):
        self._results: deque = deque()

    def put(self, task) -> None:
        try:
            self._results.append((True, (task, task.compute())))
        except Exception:  # handed back like torchgpipe's worker does; the pipeline re-raises it
            self._results.append((False, sys.exc_info()))

    def get(self):
        return self._results.popleft()


_lock = threading.Lock()
_open = 0                 # inline_tasks contexts open in this process (any thread)
_replaced = None          # what torchgpipe.pipeline.spawn_workers was when the first of them opened
_thread = threading.local()  # .depth: inline_tasks contexts open on this thread


@contextmanager
def _workers(devices: Sequence[torch.device]) -> Iterator[tuple[list, list]]:
    if getattr(_thread, "depth", 0) == 0 or any(torch.device(d).type != "cpu" for d in devices):
        with spawn_workers(devices) as queues:
            yield queues
        return
    inline = InlineWorker()
    yield [inline] * len(devices), [inline] * len(devices)


@contextmanager
def inline_tasks() -> Iterator[None]:
    """Within the context, all-CPU torchgpipe pipelines run by this thread compute their tasks on it; on leaving
    the last such context (of any thread) ``torchgpipe.pipeline.spawn_workers`` is put back as it was."""
    global _open, _replaced
    with _lock:
        if _open == 0:
            _replaced = torchgpipe.pipeline.spawn_workers
            torchgpipe.pipeline.spawn_workers = _workers
        _open += 1
    _thread.depth = getattr(_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _thread.depth -= 1
        with _lock:
            _open -= 1
            if _open == 0:
                torchgpipe.pipeline.spawn_workers, _replaced = _replaced, None


class InlineGPipe(GPipe):
    """``torchgpipe.GPipe`` whose forward runs its all-CPU tasks on the calling thread (:func:`inline_tasks`);
    with any GPU, and everything else, it is torchgpipe's GPipe."""

    def forward(self, input):
        with inline_tasks():
            return super().forward(input)

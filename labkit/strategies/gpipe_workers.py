"""torchgpipe on CPU: run each task on the calling thread instead of a worker thread started per mini-batch.

torchgpipe hands each partition's forward tasks to a worker thread per device, and starts those threads anew
in every forward call (``torchgpipe.pipeline.spawn_workers``). Partitions on one device share one worker, so
on a CPU (``devices = P × cpu``) the tasks already run one after another, in the order they are queued, while
the calling thread waits. What the thread adds there is cost: the first operators a new thread runs pay for
its own OpenMP team and oneDNN state, every mini-batch again, and afterwards its team and the caller's (which
runs backward) spin on the same cores. Measured on 2 cores, one forward of 32 samples (median of 30): LeNet
1.34 ms on the calling thread, 5.67 ms on a fresh thread; ResNet-20 50.5 / 79.2 ms. GPipe on CPU was 1.3–2.2×
slower than the same micro-batches run plainly; a worker kept alive between mini-batches was slower still on
LeNet (the two teams' spinning).

:func:`install` replaces torchgpipe's ``spawn_workers`` with one that, for an all-CPU pipeline, gives the
pipeline queues whose ``put`` runs the task at once on the calling thread — what torchgpipe's ``worker`` loop
does with it: ``task.compute()``, and ``(True, (task, batch))`` or ``(False, exc_info)`` handed back in order.
The schedule, the micro-batches, checkpointing and recomputation are torchgpipe's, unchanged (the GPipe tests
compare them with plain training). A pipeline with any GPU keeps torchgpipe's own worker threads, which let
its devices compute at the same time.
"""
from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torchgpipe.pipeline
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


@contextmanager
def _workers(devices: Sequence[torch.device]) -> Iterator[tuple[list, list]]:
    if any(torch.device(d).type != "cpu" for d in devices):
        with spawn_workers(devices) as queues:
            yield queues
        return
    inline = InlineWorker()
    yield [inline] * len(devices), [inline] * len(devices)


def install() -> None:
    """Make every torchgpipe pipeline in this process run its CPU tasks inline (idempotent)."""
    torchgpipe.pipeline.spawn_workers = _workers

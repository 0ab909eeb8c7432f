"""Stop cleanly when the cluster asks, and continue later from the very step where the run stopped.

Two signals mean "stop soon":

* ``SIGUSR1``: SLURM's warning before the time limit or a pre-emption, asked for with
  ``#SBATCH --signal=B:USR1@120``; the job script passes it on to the ranks (see ``jobs/README.md``).
* ``SIGTERM``: what ``scancel``, pre-emption and the time limit send (torchrun forwards it to its ranks);
  SLURM sends ``SIGKILL`` only ``KillWait`` seconds later (30 s by default): the grace period.

The handler only records the signal. :func:`labkit.train.loop.fit` finishes the step in progress, the ranks
agree to stop after the same step (an all-reduce of their flags: a signal reaches the ranks at slightly
different moments), the checkpoint of that point is written atomically, and ``labkit train`` exits with
:data:`EXIT_PREEMPTED` after writing ``<out>/preempted.json``, which tells the job script to requeue.

Asking every step would cost a collective per step, and on a GPU a device-to-host copy that waits for the
whole queue: a cost the plain loop does not have. So (:class:`StopCheck`) the ranks ask about every
:data:`CHECK_EVERY_S` seconds of training (rank 0 turns its step time into a number of steps, and the answer
carries it to all ranks), with a non-blocking all-reduce whose answer is read one step later. A signal stops
the run within ``CHECK_EVERY_S`` plus two steps; a step slower than ``CHECK_EVERY_S`` is checked after each step.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.errors import LabkitError
from labkit.results import atomic_write_text

#: exit code of a run stopped by a signal after writing its checkpoint (EX_TEMPFAIL: "try again later")
EXIT_PREEMPTED = 75
#: written next to the checkpoint when a run stopped early; removed when the run finishes
MARKER = "preempted.json"
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
#: seconds of training between two stop checks within an epoch (SIGTERM leaves 30 s, SLURM's warning minutes)
CHECK_EVERY_S = 0.2
#: the most steps between two checks, however fast a step is
MAX_CHECK_STEPS = 1000


class Preempted(LabkitError):
    """The run stopped on a signal after checkpointing; ``--resume`` continues it.

    Args:
        signal_name: the signal this rank received (None: another rank's signal stopped it).
        epoch: epochs completed.
        step: steps done in epoch ``epoch + 1`` (0: stopped between epochs).
    """

    exit_code = EXIT_PREEMPTED

    def __init__(self, signal_name: str | None, epoch: int, step: int):
        super().__init__(f"stopped on {signal_name or 'a signal to another rank'} {where(epoch, step)}; the "
                         "checkpoint is written: run the same command with --resume to continue")
        self.signal_name, self.epoch, self.step = signal_name, epoch, step


def where(epoch: int, step: int) -> str:
    """Where a run stopped or resumes, in the words of both lines: ``epoch`` epochs done and ``step`` steps of the
    next one (``after epoch 1``, ``in epoch 2 after step 9``)."""
    return f"after epoch {epoch}" if step == 0 else f"in epoch {epoch + 1} after step {step}"


class StopSignals:
    """Record SIGUSR1/SIGTERM while training instead of dying; restore the previous handlers on exit.

    Usable as a context manager. Handlers can only be installed from the main thread; elsewhere (a
    training thread) the object stays inert and :meth:`requested` is always False.

    Args:
        every_s: within an epoch, the ranks agree about this often (:class:`StopCheck`).
        every_steps: agree every this many steps instead (a fixed cadence, e.g. for a test that counts them).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS, every_s: float = CHECK_EVERY_S,
                 every_steps: int | None = None):
        self.signals = signals
        self.every_s, self.every_steps = every_s, every_steps
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self, strategy=None) -> bool:
        """Whether any rank received a stop signal; every rank gets the same answer (a blocking all-reduce:
        the loop asks this between epochs; within one it asks through a :class:`StopCheck`).

        Args:
            strategy: its ``all_reduce_sum`` spans every rank of the job (None: this process alone).
        """
        flag = torch.tensor([0.0 if self.received is None else 1.0], dtype=torch.float64)
        if strategy is not None and strategy.env.distributed:
            flag = strategy.all_reduce_sum(flag)
        return flag.item() > 0


class StopCheck:
    """The stop check within one epoch: :meth:`after_step` after every step, :meth:`close` when it ends.

    After step ``s`` it launches a non-blocking all-reduce of ``[this rank's flag, rank 0's next interval]``
    and reads it after step ``s + 1``; the next one is launched ``k`` steps after ``s``, with ``k`` the number
    of steps rank 0 ran in ``every_s`` seconds (the sum carries it to every rank, so all ranks launch after
    the same steps). On a GPU the answer is copied to pinned host memory behind an event: reading it waits
    for one step's old work, not for the queue. A strategy whose ranks run different numbers of steps
    (``strategy.step_boundary()`` is False) is not asked within the epoch.

    Args:
        signals: the recorded signals.
        strategy: whose ranks must agree; its ``step_boundary()`` runs before each launch.
        steps: the epoch's steps (no check is launched whose answer would come after its last step).
    """

    def __init__(self, signals: StopSignals, strategy, steps: int):
        self.signals, self.strategy, self.steps = signals, strategy, steps
        self.distributed = strategy.env.distributed
        self.cuda = strategy.env.device.type == "cuda"
        self.next: int | None = None  # the step after which the next check is launched (None: the first step)
        self.pending = None  # (launch step, work or event, the answer's tensor)
        self.clock = (time.perf_counter(), 0)  # rank 0: (time, step) of the last launch
        self.within = True  # False: the strategy cannot agree within an epoch
        if self.cuda:
            self.send = torch.zeros(2, dtype=torch.float64).pin_memory()
            self.recv = torch.zeros(2, dtype=torch.float64).pin_memory()
            self.flag = torch.zeros(2, dtype=torch.float64, device=strategy.env.device)

    def after_step(self, step: int) -> bool:
        """Call after step ``step`` (0-based) of the epoch; True: every rank stops after this very step."""
        if not self.distributed:
            return self.signals.received is not None and step + 1 < self.steps
        if not self.within:
            if self.signals.received is not None and self.within is False:
                self.within = None  # noted once
                print(f"rank {self.strategy.env.rank}: stop signal: the ranks of this strategy run different "
                      "numbers of steps; the run stops at the end of this epoch, after its checkpoint", flush=True)
            return False
        stop = False
        if self.pending is not None:
            stop, k = self._read()
            self.next = self.pending[0] + k
            self.pending = None
        if stop and step + 1 < self.steps:  # after the last step the epoch's end stops the run
            self.strategy.step_boundary()  # the checkpoint's collectives follow
            return True
        if (self.next is None or step >= self.next) and step + 2 < self.steps:
            self._launch(step)
        return False

    def close(self) -> None:
        """Wait for a check still in flight (its answer comes too late for this epoch; the epoch's end asks)."""
        if self.pending is not None:
            self._read()
            self.pending = None

    def _interval(self, step: int) -> float:
        """Rank 0's steps until the next check: ``every_steps``, or as many as fit in ``every_s``."""
        if self.signals.every_steps is not None:
            return float(self.signals.every_steps)
        now, (then, then_step) = time.perf_counter(), self.clock
        self.clock = (now, step)
        if self.next is None:
            return 1.0  # no step timed yet: ask again after the next one
        per_step = (now - then) / max(step - then_step, 1)
        return float(min(max(int(self.signals.every_s / max(per_step, 1e-9)), 1), MAX_CHECK_STEPS))

    def _launch(self, step: int) -> None:
        if not self.strategy.step_boundary():
            self.within = False
            return
        mine = [float(self.signals.received is not None), self._interval(step) if self.strategy.env.rank == 0 else 0]
        if self.cuda:
            self.send.copy_(torch.tensor(mine, dtype=torch.float64))
            self.flag.copy_(self.send, non_blocking=True)
            dist.all_reduce(self.flag)  # queued on the device: the host does not wait
            self.recv.copy_(self.flag, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self.pending = (step, done, self.recv)
        else:
            flag = torch.tensor(mine, dtype=torch.float64)
            self.pending = (step, dist.all_reduce(flag, async_op=True), flag)

    def _read(self) -> tuple[bool, int]:
        _, waitable, answer = self.pending
        if self.cuda:
            waitable.synchronize()
        else:
            waitable.wait()
        return answer[0].item() > 0, max(int(answer[1].item()), 1)


def signal_of_any_rank(received: str | None, env) -> str | None:
    """The signal that stopped the run: this rank's, else the first other rank's that got one.

    Called once by every rank of the job as it stops (``env``: its :class:`~labkit.dist.group.DistEnv`), so that
    ``preempted.json`` and every rank's ``labkit: stopped on ...`` line name the signal even when only a
    non-zero rank received it.
    """
    if not env.distributed:
        return received
    import torch.distributed as dist

    names: list[str | None] = [None] * env.world_size
    dist.all_gather_object(names, received)
    return received or next((name for name in names if name is not None), None)


def now_utc() -> str:
    """``2026-11-29T05:41:07Z``: when an attempt started or stopped."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def attempt_started(resumed_at: dict | None) -> dict:
    """The ``metrics.jsonl`` record of an attempt's start; ``resumed_at``: ``{"epoch", "step"}`` of the
    checkpoint it continues (epochs completed, steps into the next), None for a fresh start."""
    return {"kind": "attempt", "event": "start", "time": now_utc(), "resumed_at": resumed_at}


def attempt_stopped(signal_name: str | None, epoch: int, step: int) -> dict:
    """The record of an attempt stopped on a signal after its checkpoint at ``{"epoch", "step"}``."""
    return {"kind": "attempt", "event": "stop", "time": now_utc(), "signal": signal_name,
            "stopped_at": {"epoch": epoch, "step": step}}


def attempts(records: list[dict], finished: str) -> list[dict]:
    """Every attempt of a run, from its start and stop records (oldest first), the last one finished at
    ``finished``: ``{"started", "resumed_at", "ended", "signal", "stopped_at"}``. An attempt with no stop record
    before the next start ended without one (killed, or failed): its ``ended`` is None."""
    runs: list[dict] = []
    for record in records:
        if record.get("event") == "start":
            runs.append({"started": record["time"], "resumed_at": record["resumed_at"], "ended": None,
                         "signal": None, "stopped_at": None})
        elif record.get("event") == "stop" and runs:
            runs[-1].update(ended=record["time"], signal=record["signal"], stopped_at=record["stopped_at"])
    if runs:
        runs[-1]["ended"] = finished
    return runs


def write_marker(out_dir: Path, epoch: int, step: int, signal_name: str | None) -> None:
    """``<out>/preempted.json``: where the run stopped; a job script requeues when it exists."""
    atomic_write_text(Path(out_dir) / MARKER, json.dumps({"epoch": epoch, "step": step,
                                                           "signal": signal_name}) + "\n")


def clear_marker(out_dir: Path) -> None:
    (Path(out_dir) / MARKER).unlink(missing_ok=True)

"""Stop cleanly when the cluster asks, and continue later from the very step where the run stopped.

Two signals mean "stop soon":

* ``SIGUSR1``: SLURM's warning before the time limit or a pre-emption, asked for with
  ``#SBATCH --signal=B:USR1@120``; the job script passes it on to the ranks (see ``jobs/README.md``).
* ``SIGTERM``: what ``scancel``, pre-emption and the time limit send (torchrun forwards it to its ranks);
  SLURM sends ``SIGKILL`` only ``KillWait`` seconds later (30 s by default): the grace period.

The handler only records the signal. :func:`labkit.train.fit` finishes the step in progress, the ranks
agree to stop after the same step (an all-reduce of their flags: a signal reaches the ranks at slightly
different moments), the checkpoint of that point is written atomically, and ``labkit train`` exits with
:data:`EXIT_PREEMPTED` after writing ``<out>/preempted.json``, which tells the job script to requeue.
"""
from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import torch

from labkit.errors import LabkitError
from labkit.results import atomic_write_text

#: exit code of a run stopped by a signal after writing its checkpoint (EX_TEMPFAIL: "try again later")
EXIT_PREEMPTED = 75
#: written next to the checkpoint when a run stopped early; removed when the run finishes
MARKER = "preempted.json"
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(LabkitError):
    """The run stopped on a signal after checkpointing; ``--resume`` continues it.

    Args:
        signal_name: the signal this rank received (None: another rank's signal stopped it).
        epoch: epochs completed.
        step: steps done in epoch ``epoch + 1`` (0: stopped between epochs).
    """

    exit_code = EXIT_PREEMPTED

    def __init__(self, signal_name: str | None, epoch: int, step: int):
        where = f"after epoch {epoch}" if step == 0 else f"in epoch {epoch + 1} after step {step}"
        super().__init__(f"stopped on {signal_name or 'a signal to another rank'} {where}; the "
                         "checkpoint is written: run the same command with --resume to continue")
        self.signal_name, self.epoch, self.step = signal_name, epoch, step


class StopSignals:
    """Record SIGUSR1/SIGTERM while training instead of dying; restore the previous handlers on exit.

    Usable as a context manager. Handlers can only be installed from the main thread; elsewhere (a
    training thread) the object stays inert and :meth:`requested` is always False.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
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
        """Whether any rank received a stop signal; every rank gets the same answer.

        Args:
            strategy: its ``all_reduce_sum`` spans every rank of the job (None: this process alone).
        """
        flag = torch.tensor([0.0 if self.received is None else 1.0], dtype=torch.float64)
        if strategy is not None and strategy.env.distributed:
            flag = strategy.all_reduce_sum(flag)
        return flag.item() > 0


def signal_of_any_rank(received: str | None, env) -> str | None:
    """The signal that stopped the run: this rank's, else the first other rank's that got one.

    Called once by every rank of the job as it stops (``env``: its :class:`~labkit.dist.DistEnv`), so that
    ``preempted.json`` and every rank's ``labkit: stopped on ...`` line name the signal even when only a
    non-zero rank received it.
    """
    if not env.distributed:
        return received
    import torch.distributed as dist

    names: list[str | None] = [None] * env.world_size
    dist.all_gather_object(names, received)
    return received or next((name for name in names if name is not None), None)


def write_marker(out_dir: Path, epoch: int, step: int, signal_name: str | None) -> None:
    """``<out>/preempted.json``: where the run stopped; a job script requeues when it exists."""
    atomic_write_text(Path(out_dir) / MARKER, json.dumps({"epoch": epoch, "step": step,
                                                           "signal": signal_name}) + "\n")


def clear_marker(out_dir: Path) -> None:
    (Path(out_dir) / MARKER).unlink(missing_ok=True)

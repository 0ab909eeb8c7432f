"""The parameter server's side of ``--strategy ps``: receive pushes, apply them, decide who may go on.

One :class:`ServerState` per server rank. The server holds a *shard* of the parameters (whole tensors,
:func:`shard_tensors`); every worker pushes the gradient of each shard to that shard's server and waits
for the new parameters (the reply, which is its pull). The modes differ only in *when* a push is applied
and *when* its reply is sent:

* ``sync``: wait for one push from every worker, apply their mean, reply to all (a round = one update);
* ``async``: apply each push as it arrives and reply at once (Hogwild-style; a gradient may be stale);
* ``ssp``: as async, but a worker more than K clocks (its own pushes) ahead of the slowest waits: its
  reply is held back until the slowest catches up (Ho et al. 2013, stale synchronous parallel).

Staleness of an update = server version when it is applied − version the gradient was computed on
(the number of updates the gradient did not see). Messages go through ``torch.distributed`` point-to-point
(``isend``/``irecv``); every wait has a timeout, so a dead worker or server is an error, not a hang.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from labkit.errors import LabkitError
from labkit.optim.kfac.distributed import assign_owners

MODES = ("sync", "async", "ssp")


class PeerFailure(LabkitError):
    """A parameter-server peer died or went silent past ``--ps-timeout-s``."""


def shard_tensors(params: Sequence[nn.Parameter], num_servers: int) -> list[int]:
    """Server of each parameter tensor: largest first, each to the least-loaded server.

    Whole tensors (not slices) so that layer-wise optimizers (LARS, LAMB) see whole layers.
    """
    return assign_owners([p.numel() for p in params], num_servers)


def wait(work, timeout_s: float, what: str) -> None:
    """Wait for a point-to-point ``work``; a dead or silent peer becomes a :class:`PeerFailure` naming ``what``."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        cause = str(exc).strip().splitlines()[0][:200]
        raise PeerFailure(f"{what}: nothing arrived within {timeout_s:g} s (--ps-timeout-s) or the peer died "
                          f"[{cause}]") from None


class ServerState:
    """What one server knows: its parameters, the workers' clocks, the versions it sent, the record.

    Args:
        params: this server's parameter tensors (its shard), updated in place by the training loop's
            optimizer step.
        workers: global ranks of the workers.
        mode: ``sync``, ``async`` or ``ssp``.
        max_staleness: K for ``ssp`` (ignored otherwise).
        timeout_s: how long a server waits for any push before declaring the workers dead.
    """

    def __init__(self, params: list[nn.Parameter], workers: list[int], mode: str, max_staleness: int,
                 timeout_s: float):
        self.params, self.workers, self.mode = params, workers, mode
        self.max_staleness, self.timeout_s = max_staleness, timeout_s
        self.numel = sum(p.numel() for p in params)
        self.version = 0
        self.sent_version = {w: 0 for w in workers}
        self.record: list[dict] = []
        self.bytes = {"received": 0, "sent": 0}
        self._recv: dict[int, tuple[Tensor, object]] = {}
        self._sends: list = []
        self.start_epoch()

    def start_epoch(self) -> None:
        self.clock = {w: 0 for w in self.workers}
        self.stopped: set[int] = set()
        self.held: list[int] = []
        self.last: dict[int, dict] = {}  # each worker's latest record entry
        self.pending: list[int] = []  # pushes applied by the loop's last optimizer step, not yet answered
        self.budget_left = True
        self.started = time.perf_counter()

    # ----- messages --------------------------------------------------------------------------------------------

    def receive(self, count: int) -> list[tuple[int, Tensor]]:
        """The next ``count`` pushes as ``(worker, flat gradient)``: in arrival order (async, ssp: a receive
        from any source, which gloo has and NCCL has not), or one per worker in rank order (sync)."""
        got: list[tuple[int, Tensor]] = []
        for i in range(count):
            buf = torch.empty(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)
            src = self.workers[i] if self.mode == "sync" else None
            work = dist.irecv(buf, src=src)
            wait(work, self.timeout_s, f"server rank {dist.get_rank()} waiting for a push from "
                 + (f"worker rank {src}" if src is not None else f"workers {sorted(set(self.workers) - self.stopped)}"))
            got.append((src if src is not None else work._source_rank(), buf))
            self.bytes["received"] += buf.numel() * buf.element_size()
        return got

    def reply(self, worker: int, stop: bool) -> None:
        """Send ``[version, stop]`` and this shard's parameters to ``worker`` (its pull)."""
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]
        header = torch.tensor([self.version, int(stop)], dtype=torch.int64, device=self.params[0].device)
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        # the tensors ride along with their works: gloo reads them until the send completes
        self._sends += [(dist.isend(header, dst=worker), header), (dist.isend(flat, dst=worker), flat)]
        self.bytes["sent"] += flat.numel() * flat.element_size()
        self.sent_version[worker] = self.version
        if stop:
            self.stopped.add(worker)

    def flush(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    # ----- one update ---------------------------------------------------------------------------------------------

    def set_grads(self, pushes: list[tuple[int, Tensor]]) -> None:
        """Write the pushed gradient (sync: the mean over the workers, summed in rank order) into ``.grad``.

        Also records each push's staleness against the version the loop's optimizer step is about to
        replace.
        """
        pushes = sorted(pushes) if self.mode == "sync" else pushes
        flat = pushes[0][1] if len(pushes) == 1 else torch.stack([g for _, g in pushes]).sum(0) / len(pushes)
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        now = time.perf_counter() - self.started
        for w, _ in pushes:
            self.clock[w] += 1
            self.last[w] = {"version": self.version + 1, "worker": w, "clock": self.clock[w],
                            "staleness": self.version - self.sent_version[w], "ahead": None, "time_s": now}
            self.record.append(self.last[w])
        self.pending = [w for w, _ in pushes]

    def after_step(self, budget_reached: bool) -> None:
        """The optimizer step applied the pending pushes: bump the version, answer whoever may go on."""
        if not self.pending:
            return
        self.version += 1
        self.held += self.pending
        self.pending = []
        self.budget_left = not budget_reached
        slowest = min(self.clock.values())
        for w in list(self.held):
            ahead = self.clock[w] - slowest
            if budget_reached or self.mode != "ssp" or ahead <= self.max_staleness:
                self.held.remove(w)
                if not budget_reached:
                    self.last[w]["ahead"] = ahead  # clocks ahead of the slowest when it goes on
                self.reply(w, stop=budget_reached)

    def drain(self) -> None:
        """End of epoch: answer every worker still computing with ``stop`` (its push is not applied)."""
        while len(self.stopped) < len(self.workers):
            for w, _ in self.receive(1):
                self.reply(w, stop=True)
        self.flush()

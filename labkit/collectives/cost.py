"""The alpha-beta(-gamma) cost model of a schedule, fitted on this machine, and bus bandwidth.

A message of ``b`` bytes costs ``alpha + beta * b`` (latency + inverse bandwidth); adding ``b`` bytes into
a buffer costs ``gamma * b``. Within a step the busiest rank sets the pace, so

    T = sum over steps of  alpha * m_s + beta * b_s + gamma * r_s

with ``m_s`` the most messages one rank sends (or receives) in step ``s``, ``b_s`` the most bytes and
``r_s`` the most bytes one rank adds. For the ring that is ``2(p-1) (alpha + beta n/p)`` (+ reduction),
the seed formula ``Total_Comm_Time = 2 x (N-1) x T_transfer`` with ``T_transfer = alpha + beta n/N``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from labkit.collectives.schedule import Schedule
from labkit.collectives.simulate import count
from labkit.errors import ConfigError


@dataclass(frozen=True)
class CostModel:
    """``alpha`` s per message, ``beta`` s per byte sent, ``gamma`` s per byte reduced."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def predict(self, schedule: Schedule, n: int, itemsize: int = 4) -> float:
        """Predicted seconds to run ``schedule`` on ``n`` elements of ``itemsize`` bytes."""
        return sum(self.alpha * s.messages + (self.beta * s.elements + self.gamma * s.reduced) * itemsize
                   for s in count(schedule, n).per_step)

    def transfer_time(self, nbytes: float) -> float:
        """One point-to-point message: ``alpha + beta * nbytes``."""
        return self.alpha + self.beta * nbytes


def ring_formula(world_size: int, t_transfer: float) -> float:
    """The seed formula ``Total_Comm_Time = 2 x (N-1) x T_transfer`` (``T_transfer`` = one chunk of n/N)."""
    return 2 * (world_size - 1) * t_transfer


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least-squares fit of ``seconds = alpha + beta * nbytes``, relative errors weighted alike.

    Noise can tilt the fit (e.g. a slow small message); the result is kept physical: ``beta > 0`` (else the
    largest message's time per byte) and ``alpha >= 0``, with ``alpha`` then refitted for that ``beta`` by the same
    weighted least squares, ``alpha = Σ w²(y - beta·x) / Σ w²``, so the line still runs through the points (not
    under all of them).

    Args:
        nbytes: message sizes (at least two distinct).
        seconds: measured one-way times, same length.
    """
    x, y = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if x.shape != y.shape or len(np.unique(x)) < 2:
        raise ConfigError(f"need times for at least two distinct sizes to fit alpha and beta, got sizes {x.tolist()}")
    # Relative errors matter at every size: weight each point by 1/time so tiny messages still pin alpha.
    w = 1.0 / np.maximum(y, 1e-12)
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, y * w, rcond=None)
    if beta <= 0:
        beta = y[np.argmax(x)] / x.max()
        alpha = np.sum(w ** 2 * (y - beta * x)) / np.sum(w ** 2)
    if alpha < 0:
        beta = np.sum(w ** 2 * x * y) / np.sum(w ** 2 * x * x)  # the best line through the origin
        alpha = 0.0
    return float(alpha), float(beta)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth, bytes/s: the vector size over the time (as nccl-tests)."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth for all-reduce as nccl-tests defines it: ``algbw * 2(p-1)/p``.

    The factor turns the time into the rate each rank's link must sustain under an optimal (ring-like)
    algorithm, so numbers compare across world sizes and with the hardware's link bandwidth.
    """
    return algbw(nbytes, seconds) * 2 * (world_size - 1) / world_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_p2p(sizes: list[int], repeats: int = 5, device: torch.device | str = "cpu",
                group=None, inner: int = 3, quantile: float = 0.5) -> list[tuple[int, float]]:
    """Time of one point-to-point message of each size (bytes), measured as schedules use the network.

    Every rank sends ``nbytes`` to rank ``(r + 1) % p`` while receiving as much from ``(r - 1) % p``, which
    is one ring step: all ranks busy at once, as in every step of every schedule (so the fit includes
    contention and, on an oversubscribed CPU, the wait for the peer process to be scheduled). Each
    repeat times ``inner`` exchanges on the slowest rank; the median over repeats is reported (``quantile``: another
    quantile, e.g. 0.25 on a virtual machine whose latency has slow spells lasting seconds).

    Every rank of the group must call it. Returns the same ``[(bytes, seconds), ...]`` on all ranks.
    """
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    out = []
    for nbytes in sizes:
        send = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        recv = torch.empty_like(send)
        times = []
        for i in range(repeats + 1):
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(inner):
                ops = [dist.P2POp(dist.irecv, recv, peer((rank - 1) % p), group),
                       dist.P2POp(dist.isend, send, peer((rank + 1) % p), group)]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            _sync(send.device)
            elapsed = torch.tensor((time.perf_counter() - start) / inner, dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if i:  # the first round pays for connection set-up
                times.append(elapsed.item())
        out.append((send.numel() * 4, float(np.quantile(times, quantile))))
    return out


def measure_gamma(nbytes: int = 4 << 20, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Seconds per byte of ``a += b`` on this rank (the fastest of ``repeats``)."""
    a = torch.zeros(nbytes // 4, device=device)
    b = torch.ones_like(a)
    times = []
    for _ in range(repeats):
        _sync(a.device)
        start = time.perf_counter()
        a.add_(b)
        _sync(a.device)
        times.append(time.perf_counter() - start)
    return min(times) / (a.numel() * 4)


def fit_cost_model(sizes: list[int] | None = None, repeats: int = 5, device: torch.device | str = "cpu",
                   group=None, quantile: float = 0.5, inner: int = 3) -> tuple[CostModel, list[tuple[int, float]]]:
    """Measure point-to-point times and a local add on this machine and fit a :class:`CostModel`.

    Returns the model (identical on every rank) and the ``(bytes, seconds)`` points it was fitted to.
    """
    sizes = sizes or [4, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20]
    points = measure_p2p(sizes, repeats, device, group, inner=inner, quantile=quantile)
    alpha, beta = fit_alpha_beta(*zip(*points))
    gamma = torch.tensor(measure_gamma(repeats=repeats, device=device), dtype=torch.float64, device=device)
    dist.all_reduce(gamma, group=group)
    return CostModel(alpha, beta, gamma.item() / dist.get_world_size(group)), points

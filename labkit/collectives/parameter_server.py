"""The centralised architecture: parameter servers hold the parameters, workers push and pull.

Ranks ``0 .. S-1`` are servers, ranks ``S .. p-1`` are the ``W = p - S`` workers. The parameter vector
is sharded: server ``s`` holds chunk ``s`` (``S`` chunks). Decentralised all-reduce algorithms mirror the
parameters on every rank instead (see :data:`labkit.collectives.ALGORITHMS`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.collectives.algorithms import check_world_size
from labkit.collectives.schedule import Op, Schedule, ScheduleError, Step, Transfer

if TYPE_CHECKING:  # the schedule itself is plain data; torch loads only when it runs (keeps `labkit --help` fast)
    import torch


def parameter_server(world_size: int, num_servers: int = 1) -> Schedule:
    """Push gradients to the servers, pull the sums back.

    * push (1 step): every worker sends chunk ``s`` to server ``s``, which adds it to a zeroed buffer.
    * pull (1 step): every server ``s`` sends its summed chunk ``s`` to every worker.

    Steps 2; ``2 S W`` messages of ``n/S`` elements. A worker sends ``n`` and receives ``n``; a server
    receives ``W n/S`` and sends ``W n/S``. Time ``2(W alpha + W/S beta n)``: adding servers shares the load.
    """
    p = check_world_size(world_size)
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or not 1 <= num_servers < p:
        raise ScheduleError(f"num_servers must be between 1 and world_size - 1 = {p - 1} so at least one "
                            f"worker remains, got {num_servers!r}")
    servers, workers = range(num_servers), range(num_servers, p)
    push = Step("workers push gradients", tuple(Transfer(w, s, s, s + 1, Op.REDUCE) for w in workers for s in servers))
    pull = Step("workers pull the sums", tuple(Transfer(s, w, s, s + 1, Op.COPY) for s in servers for w in workers))
    return Schedule("parameter-server", p, num_servers, (push, pull), servers=tuple(servers))


def push_pull(tensor: torch.Tensor, num_servers: int = 1, group=None) -> torch.Tensor:
    """Run :func:`parameter_server` over the default process group, in place.

    On a worker ``tensor`` is its gradient and becomes the sum over all workers. On a server it is the
    buffer of its shard: it is zeroed, and afterwards its chunk ``s`` holds that shard's sum.
    """
    import torch.distributed as dist

    from labkit.collectives.execute import run_schedule

    schedule = parameter_server(dist.get_world_size(group), num_servers)
    run_schedule(tensor, schedule, group=group)
    return tensor


def sgd_step(param: torch.Tensor, grad: torch.Tensor, lr: float, num_servers: int = 1, group=None) -> torch.Tensor:
    """One synchronous parameter-server SGD step on flat vectors, in place on ``param``.

    Workers push ``grad``; server ``s`` updates its shard ``param_s <- param_s - lr * sum_w(grad_w)_s / W``;
    workers pull the updated shard into ``param``. Servers keep the authoritative parameters, so workers'
    ``param`` values before the step are ignored (they are overwritten by the pull).

    Args:
        param: ``(n,)`` parameters (on servers: the parameters; on workers: overwritten).
        grad: ``(n,)`` gradient of this worker (ignored on servers).
        lr: learning rate.
    """
    import torch.distributed as dist

    from labkit.collectives.execute import run_schedule

    p = dist.get_world_size(group)
    rank = dist.get_rank(group)
    schedule = parameter_server(p, num_servers)
    bounds = schedule.chunk_bounds(param.numel())
    buf = grad.detach().clone().reshape(-1)
    run_schedule(buf, schedule, group=group, steps=range(0, 1))  # push
    if rank in schedule.servers:
        a, b = bounds[rank]
        param.view(-1)[a:b].sub_(buf[a:b], alpha=lr / (p - num_servers))
    run_schedule(param.view(-1), schedule, group=group, steps=range(1, 2))  # pull
    return param

"""The centralised architecture: parameter servers hold the parameters, workers push and pull.

Ranks ``0 .. S-1`` are servers, ranks ``S .. p-1`` are the ``W = p - S`` workers. The parameter vector
is sharded: server ``s`` holds chunk ``s`` (``S`` chunks). Decentralised all-reduce algorithms mirror the
parameters on every rank instead (see :data:`labkit.collectives.ALGORITHMS`).
The schedule is plain data; :func:`labkit.collectives.execute.push_pull` runs it.
"""
from __future__ import annotations

from labkit.collectives.algorithms import check_world_size
from labkit.collectives.schedule import Op, Schedule, ScheduleError, Step, Transfer


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


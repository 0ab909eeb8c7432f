"""The rendezvous store of ranks that this machine's launchers start themselves (run_ranks, the faults runner,
the fault-tolerant supervisor's replicas), hosted the way torchrun's agent hosts its own.

    with hosted_store(ctx) as rendezvous:     # {"MASTER_ADDR": ..., "MASTER_PORT": ..., ...}
        ...start the ranks with these variables added to their environment...

Why not a free port that rank 0 binds: a port found free (bound to port 0 and let go) stays free only until
someone else takes it. Between that moment and rank 0's ``init_process_group`` (seconds, while the rank starts)
any other process on the machine may bind it or use it as the local end of a connection. Rank 0 then fails to
bind, and the other ranks wait on that address until their timeout: a run that hangs for minutes outside any
collective, where no watchdog looks.

Here a process of its own binds the store's port as it chooses it (port 0: the system picks one nobody holds)
and serves the store until the ranks are done. The ranks get its address with
``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's own variable: every rank, rank 0 included, connects to it
as a client (``torch.distributed.rendezvous``), the program's ``init_process_group`` unchanged. The store is
not served from the launcher's own process: that process forks the ranks, and a fork copies whatever lock
the store's server thread holds at that moment, held for ever in the child.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator

#: how long the launcher waits for the store's process to bind its port
START_TIMEOUT_S = 60.0


def _serve(conn) -> None:
    """The store's process: bind, say the port, serve until killed (or until its parent is gone)."""
    import torch.distributed as dist

    # host, port 0 (the system's choice, bound now), any world size, the server, its timeout, no wait for workers
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), False)
    conn.send(store.port)
    conn.close()
    parent = os.getppid()
    while os.getppid() == parent:  # a launcher killed outright leaves no store behind for long
        time.sleep(0.5)


@contextlib.contextmanager
def hosted_store(ctx) -> Iterator[dict[str, str]]:
    """A store served by a process started from ``ctx`` (a multiprocessing context) for as long as the block
    runs; yields the variables that make the ranks use it."""
    ours, theirs = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_serve, args=(theirs,), daemon=True, name="labkit-store")
    server.start()
    theirs.close()
    try:
        if not ours.poll(START_TIMEOUT_S):
            raise RuntimeError(f"the ranks' rendezvous store did not start within {START_TIMEOUT_S:.0f} s")
        port = ours.recv()
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        ours.close()
        if server.is_alive():
            server.kill()
        server.join()

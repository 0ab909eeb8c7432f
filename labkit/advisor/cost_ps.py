"""The synchronous parameter server's price (``--strategy ps``; notation: :mod:`labkit.advisor.cost`).

Ranks ``0 .. S−1`` are servers, the other ``W = p − S`` are workers, each training ``b = B/W`` samples. The
servers hold the parameters in shards of whole layers (the strategy shards whole tensors, largest first to
the least-loaded server; a layer's bias is small beside its weight), ``P_max`` bytes on the fullest one.
Notebook 01's count: each server receives ``W·P/S`` bytes per step and sends as much back, through its own
link, one message after another — the server's link is the bottleneck, not the workers'.
"""
from __future__ import annotations

from labkit.advisor.cost import common_terms, memory_terms, message_time
from labkit.advisor.plan import Estimate, Plan
from labkit.advisor.profile import Profile
from labkit.advisor.topology import Topology

HEADER_BYTES = 16  # the reply's [version, stop] int64 pair


def shard_bytes(prof: Profile, servers: int) -> list[float]:
    """Bytes on each server: layers largest first, each to the least-loaded server."""
    load = [0.0] * servers
    for nbytes in sorted((layer.param_bytes for layer in prof.layers if layer.param_bytes), reverse=True):
        load[load.index(min(load))] += nbytes
    return load


def price_ps(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """One synchronous update: every worker computes, pushes, waits; each server sums, steps, replies.

    ``compute = s_W·T_all(b)`` with ``s_W`` the oversubscription of the ``W`` workers alone (the servers sleep
    in their receive while the workers compute); ``communication = W·(2·msg(P_max) + msg(16)) + γ·W·P_max``
    (the fullest server takes ``W`` pushes, sums them, and sends each worker a header and its parameters);
    ``update = u·P_max`` (the server's optimizer over its shard; a worker's step has no gradient to apply);
    ``data = d·b``. Memory, the fuller of a worker ``P + P + 2P + M_all(b)`` (parameters, gradients, the flat
    push and the pulled copy) and a server ``3·P_max + 2W·P_max`` (its shard, gradient and momentum; the
    ``W`` received pushes and their stack).
    """
    servers = plan.option.get("ps_servers", 1)
    workers = plan.processes - servers
    if workers < 1:
        return Estimate(plan, note=f"--ps-servers {servers} leaves no worker among {plan.processes} ranks")
    if sum(1 for layer in prof.layers if layer.param_bytes) < servers:
        return Estimate(plan, note=f"fewer layers with parameters than --ps-servers {servers}")
    b, P = plan.batch_size / workers, prof.param_bytes
    fullest = max(shard_bytes(prof, servers))
    link = topo.collective_link(plan.processes)
    comm = workers * (2 * message_time(fullest, topo, plan.processes) + message_time(HEADER_BYTES, topo, plan.processes)
                      ) + link.gamma * workers * fullest
    time = {"compute": topo.oversubscription(workers) * topo.compute_scale * prof.time(b), "communication": comm,
            **common_terms(prof, topo, fullest, b)}
    worker = memory_terms(prof, topo, P, prof.saved_bytes(b), 2 * P)
    worker["optimizer"] = 0.0
    server = memory_terms(prof, topo, fullest, 0.0, 2 * workers * fullest)
    return Estimate(plan, time, max(worker, server, key=lambda m: sum(m.values())))

"""The registry of pricing functions: a strategy is searched when it has one here."""
from __future__ import annotations

from labkit.advisor.cost import (
    price_ddp,
    price_hybrid,
    price_one_process_pipeline,
    price_pipeline,
    price_single,
    price_tensor_parallel,
)
from labkit.advisor.cost_ps import price_ps
from labkit.advisor.cost_sharded import price_sharded
from labkit.advisor.plan import Estimate, Plan
from labkit.advisor.profile import Profile
from labkit.advisor.topology import Topology

#: strategy name -> pricing function (the formula is in its docstring)
PRICERS = {
    "single": price_single,
    "ddp": price_ddp,
    "hybrid": price_hybrid,
    "tensor-parallel": price_tensor_parallel,
    "pipeline": price_pipeline,
    "gpipe": price_one_process_pipeline,
    "model-parallel": price_one_process_pipeline,
    "zero": price_sharded,
    "fsdp": price_sharded,
    "ps": price_ps,
}


def price(plan: Plan, prof: Profile, topo: Topology) -> Estimate:
    """The estimate of ``plan`` with ``prof`` measured at the plan's threads per process. Every plan also pays
    the training loop's own work per step, ``bookkeeping = loop_s`` (:class:`labkit.advisor.profile.Profile`,
    where measured). The loop's stop check is not priced: it is one tiny non-blocking all-reduce every few tenths
    of a second (:class:`labkit.preempt.StopCheck`), nothing measurable per step."""
    est = PRICERS[plan.strategy](plan, prof, topo)
    if est.applicable:
        if prof.loop_s:
            est.time["bookkeeping"] = prof.loop_s  # host Python and tiny ops: not scaled with the device
    est.limit_bytes = topo.memory_bytes
    return est

"""The executor over real gloo ranks: every algorithm == dist.all_reduce for p = 2, 3, 4, 5.

Starting ranks is the slow part, so ONE spawn of 5 gloo ranks serves every test: world sizes 2, 3 and 4 run
in process groups of the first p ranks (which also tests the ``group`` argument), 5 in the default group.
Tolerance: rtol = atol = 1e-5 for float32 and 1e-12 for float64 (only the summation order differs).
"""
import pytest
import torch
import torch.distributed as dist

from labkit.collectives import (
    ALGORITHMS,
    Trace,
    all_reduce,
    count,
    get_schedule,
    push_pull,
    run_schedule,
    simulate,
    traced_run,
)
from labkit.collectives.execute import sgd_step
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _error(fn) -> str:
    try:
        fn()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    # Seeded by (rank, n): every rank can rebuild every other rank's input without communicating.
    return torch.randn(n, dtype=dtype, generator=torch.Generator().manual_seed(rank * 7919 + n))


def _cases(rank: int, p: int, group):
    """All algorithms x lengths x dtypes; one dist.all_reduce reference and one all_gather per dtype."""
    out = {"mismatch": [], "ranks_differ": [], "not_simulated": [], "checked": 0}
    for dtype in (torch.float32, torch.float64):
        cases, got = [], []
        for algorithm in ALGORITHMS + ("native",):
            for n in (1, 2 * p, 4 * p + 1):      # fewer elements than chunks, divisible, not divisible
                got.append(all_reduce(_input(rank, n, dtype), algorithm, group=group))
                cases.append((algorithm, n))
                if algorithm != "native":
                    # the executor and the one-process simulator follow the same schedule bit for bit
                    inputs = [_input(r, n, dtype) for r in range(p)]
                    if not torch.equal(simulate(get_schedule(algorithm, p), inputs).outputs[rank], got[-1]):
                        out["not_simulated"].append((algorithm, n, str(dtype)))
        want = torch.cat([_input(rank, n, dtype) for _, n in cases])
        dist.all_reduce(want, group=group)
        flat = torch.cat(got)
        everyone = [torch.empty_like(flat) for _ in range(p)]
        dist.all_gather(everyone, flat, group=group)
        offset = 0
        for (algorithm, n), value in zip(cases, got):
            piece = slice(offset, offset + n)
            offset += n
            if not torch.allclose(value, want[piece], rtol=TOL[dtype], atol=TOL[dtype]):
                out["mismatch"].append((algorithm, n, str(dtype)))
            if not all(torch.equal(e[piece], value) for e in everyone):
                out["ranks_differ"].append((algorithm, n, str(dtype)))
            out["checked"] += 1
    out["extras"] = _shapes_traces_and_ps(rank, p, group)
    return out


def _all_world_sizes(env) -> dict:
    results = {}
    for p in (2, 3, 4, 5):
        # new_group is collective: every rank creates every group, only members use it
        group = None if p == env.world_size else dist.new_group(list(range(p)))
        if env.rank < p:
            results[p] = _cases(env.rank, p, group)
    return results


def _shapes_traces_and_ps(rank: int, p: int, group):
    out = {}
    # any shape, non-contiguous too; the tensor is changed in place
    grid = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)      # (4, 3), not contiguous
    same = grid.clone()
    returned = all_reduce(grid, "rabenseifner", group=group)
    out["in_place"] = returned is grid
    out["strided"] = torch.allclose(grid, same / (rank + 1) * sum(range(1, p + 1)))
    # a trace: one record per step this rank takes part in, bytes as the simulator counts them
    schedule = get_schedule("ring", p)
    trace = traced_run(torch.ones(10 * p, dtype=torch.float64), schedule, group=group)
    c = count(schedule, 10 * p)
    mine = [r for r in trace.records if r.rank == rank]
    out["trace_steps"] = [r.step for r in mine]
    out["trace_bytes_ok"] = (sum(r.bytes_sent for r in mine) == 8 * c.elements_sent[rank]
                             and sum(r.bytes_recv for r in mine) == 8 * c.elements_recv[rank])
    out["trace_times_ok"] = all(0 <= r.start <= r.end for r in trace.records)
    out["trace_roundtrip"] = Trace.from_record(trace.to_record()) == trace
    # the parameter server: workers end with the sum over workers
    g = torch.full((7,), float(rank))
    push_pull(g, group=group)
    out["ps_worker_sum"] = g.tolist() if rank else None
    param = torch.full((6,), 10.0) if rank == 0 else torch.zeros(6)
    sgd_step(param, torch.full((6,), float(rank)), lr=0.5, group=group)
    out["ps_param"] = param.tolist()
    # bad input
    out["errors"] = [
        _error(lambda: all_reduce(torch.zeros(0), "ring", group=group)),
        _error(lambda: all_reduce(torch.ones(3), "rings", group=group)),
        _error(lambda: run_schedule(torch.ones(3), get_schedule("ring", p + 1), group=group)),
    ]
    return out


_RESULTS: list = []


def _spawned(p: int) -> list:
    """Per rank of world size ``p``: its results (the one 5-rank spawn runs on first use)."""
    if not _RESULTS:
        _RESULTS.extend(run_ranks(_all_world_sizes, 5, timeout=300))
    return [_RESULTS[rank][p] for rank in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_every_algorithm_equals_dist_all_reduce(p):
    for rank_result in _spawned(p):
        assert rank_result["mismatch"] == []
        assert rank_result["ranks_differ"] == []
        assert rank_result["not_simulated"] == []
        assert rank_result["checked"] == (len(ALGORITHMS) + 1) * 3 * 2


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_shapes_traces_parameter_server_and_errors(p):
    workers_sum = float(sum(range(1, p)))
    for rank, result in enumerate(_spawned(p)):
        r = result["extras"]
        assert r["in_place"] and r["strided"]
        assert r["trace_steps"] == list(range(1, 2 * (p - 1) + 1))
        assert r["trace_bytes_ok"] and r["trace_times_ok"] and r["trace_roundtrip"]
        if rank:
            assert r["ps_worker_sum"] == [workers_sum] * 7
        # server 0 holds 10; mean worker gradient = workers_sum / (p - 1); lr 0.5
        assert r["ps_param"] == pytest.approx([10 - 0.5 * workers_sum / (p - 1)] * 6)
        assert r["errors"][0] == "cannot all-reduce an empty tensor (shape (0,))"
        assert r["errors"][1].startswith("unknown all-reduce algorithm 'rings'; choose from ring, tree")
        assert r["errors"][2] == (f"the ring schedule is for {p + 1} ranks but the process group has {p}; "
                                  f"build it with get_schedule(name, {p})")

"""The parameter-server strategy through ``labkit.train.fit`` on gloo ranks.

One 3-rank spawn (server 0, workers 1 and 2) checks: synchronous PS == DistributedDataParallel's weights
after k steps; bytes through the server == the parameter-server formula of notebook 01 (the schedule's own
count); the staleness record in async and SSP mode (SSP: no worker ever more than K clocks ahead, staleness
within its bound; async with a straggler: the fast worker makes more updates). A 2-rank spawn checks that
async with one worker is sync, bit for bit, and that a dead worker stops the server with a clear error.
"""
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.collectives import get_schedule
from labkit.collectives.simulate import count
from labkit.errors import ConfigError
from labkit.preempt import StopSignals
from labkit.dist import DistEnv
from labkit.strategies.ps import ParameterServerStrategy
from labkit.strategies.ps_server import PeerFailure
from labkit.testing import run_ranks
from labkit.train import fit

STEPS, BATCH, LR = 3, 4, 0.1


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def train_ps(env, mode, steps=STEPS, epochs=1, **options):
    """fit() under --strategy ps; returns (flat weights, the records) on every rank."""
    strategy = ParameterServerStrategy(env, {"ps_mode": mode, "ps_timeout_s": 30, **options})
    model = strategy.prepare(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(data(), BATCH, sampler=strategy.sampler(data(), True, seed=1), drop_last=True)
    # the stop-signal check labkit train runs after every step must not put the ranks in lockstep
    fit(model, loader, None, optimizer, epochs=epochs, strategy=strategy, max_steps=steps, seed=1,
        printer=lambda *_: None, stop=StopSignals())
    return nn.utils.parameters_to_vector(model.parameters()).detach(), strategy.records()


def three_ranks(env):
    out = {"sync": train_ps(env, "sync")}
    # DDP on the two workers, same shards (DistributedSampler over 2 replicas, seed 1), same SGD
    workers = dist.new_group([1, 2])
    if env.rank > 0:
        model = net()
        ddp = DistributedDataParallel(model, process_group=workers)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        sampler = DistributedSampler(data(), num_replicas=2, rank=env.rank - 1, shuffle=True, seed=1, drop_last=True)
        sampler.set_epoch(0)
        for step, (x, y) in zip(range(STEPS), DataLoader(data(), BATCH, sampler=sampler, drop_last=True)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        out["ddp"] = nn.utils.parameters_to_vector(model.parameters()).detach()
    dist.barrier()
    out["ssp"] = train_ps(env, "ssp", steps=24, max_staleness=1, ps_slow_worker="2:4")
    out["async"] = train_ps(env, "async", steps=24, ps_slow_worker="2:4")
    return out


def test_ps_sync_is_ddp_async_and_ssp_record_staleness(one_thread):
    per_rank = run_ranks(three_ranks, 3, timeout=300)
    sync_weights, sync_record = per_rank[0]["sync"]
    for r in range(3):  # every rank holds the server's model after the epoch
        assert torch.equal(per_rank[r]["sync"][0], sync_weights)
    torch.testing.assert_close(sync_weights, per_rank[1]["ddp"], rtol=0, atol=1e-6)
    assert not torch.equal(sync_weights, nn.utils.parameters_to_vector(net().parameters()).detach())

    server = sync_record["per_server"][0]
    updates = server["updates"]
    assert [u["version"] for u in updates] == [1, 1, 2, 2, 3, 3] and all(u["staleness"] == 0 for u in updates)
    # notebook 01: with W workers and S servers each server receives (and sends) W n / S elements per step
    n = sum(p.numel() for p in net().parameters())
    formula = count(get_schedule("parameter-server", 3), n)
    assert server["bytes"] == {"received": STEPS * formula.elements_recv[0] * 4,
                               "sent": STEPS * formula.elements_sent[0] * 4}
    assert formula.elements_recv[0] == 2 * n

    ssp = per_rank[0]["ssp"][1]["per_server"][0]["updates"]
    assert len(ssp) == 24
    ahead = [u["ahead"] for u in ssp if u["ahead"] is not None]
    assert max(ahead) <= 1 and max(ahead) == 1  # K = 1 bounds it, and the straggler makes it bind
    assert max(u["staleness"] for u in ssp) <= (2 - 1) * (2 * 1 + 1)  # (W-1)(2K+1)
    asyn = per_rank[0]["async"][1]["per_server"][0]["updates"]
    fast, slow = (sum(u["worker"] == w for u in asyn) for w in (1, 2))
    assert fast + slow == 24 and fast >= 2 * slow, (fast, slow)  # the straggler does not hold the fast one back
    assert max(u["staleness"] for u in asyn) >= 2  # ... but the slow worker's gradients are stale
    for r in range(3):
        assert torch.equal(per_rank[r]["ssp"][0], per_rank[0]["ssp"][0])


def two_ranks(env, die):
    if die:
        strategy_cls = ParameterServerStrategy
        if env.rank == 1:  # the worker dies after its second push
            original = strategy_cls.sync_gradients

            def sync_then_die(self, model, calls=[0]):
                original(self, model)
                calls[0] += 1
                if calls[0] == 2:
                    os._exit(1)
            strategy_cls.sync_gradients = sync_then_die
        started = time.monotonic()
        try:
            return train_ps(env, "async", steps=6, ps_timeout_s=4)
        except PeerFailure as exc:
            raise PeerFailure(f"after {time.monotonic() - started:.1f} s: {exc}") from None
    return {mode: train_ps(env, mode, steps=4, epochs=2) for mode in ("sync", "async")}


def test_ps_async_with_one_worker_is_sync_and_a_dead_worker_is_a_clear_error(one_thread):
    per_rank = run_ranks(two_ranks, 2, False, timeout=300)
    for r in range(2):
        assert torch.equal(per_rank[r]["sync"][0], per_rank[r]["async"][0])
    with pytest.raises(RuntimeError) as failure:
        run_ranks(two_ranks, 2, True, timeout=300)
    found = re.search(r"PeerFailure: after ([0-9.]+) s: server rank 0 waiting for a push from workers \[1\]: "
                      r"nothing arrived within 4 s \(--ps-timeout-s\) or the peer died", str(failure.value))
    assert found, str(failure.value)[-2000:]
    assert float(found[1]) < 4 + 6  # a receive from any source notices the dead peer by --ps-timeout-s


def test_bad_ps_options_are_config_errors():
    env = DistEnv(rank=0, world_size=3)
    with pytest.raises(ConfigError, match="--max-staleness applies to --ps-mode ssp"):
        ParameterServerStrategy(env, {"ps_mode": "async", "max_staleness": 2})
    with pytest.raises(ConfigError, match="needs at least 4 ranks"):
        ParameterServerStrategy(env, {"ps_servers": 3})
    with pytest.raises(ConfigError, match="rank 0 is not a worker"):
        ParameterServerStrategy(env, {"ps_slow_worker": "0:2"})
    with pytest.raises(ConfigError, match="not RANK:FACTOR"):
        ParameterServerStrategy(env, {"ps_slow_worker": "fast"})


def test_bench_ps_contenders_and_time_to_target():
    from argparse import Namespace

    from labkit.bench.ps import contenders, time_to_target

    runs = contenders(Namespace(workers=2, max_staleness=1, slow_factor=3.0))
    assert runs["ddp"] == (2, ["--strategy", "ddp"])
    assert runs["ps-ssp +straggler"] == (3, ["--strategy", "ps", "--ps-mode", "ssp", "--max-staleness", "1",
                                             "--ps-slow-worker", "2:3"])
    assert len(runs) == 7
    epochs = [{"time_s": 2.0, "test_acc": 0.5}, {"time_s": 3.0, "test_acc": 0.85}, {"time_s": 1.0, "test_acc": 0.9}]
    assert time_to_target(epochs, 0.8) == 5.0 and time_to_target(epochs, 0.95) is None

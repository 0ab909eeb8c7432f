"""The parameter-server strategy through ``labkit.train.loop.fit`` on gloo ranks.

One 4-rank spawn checks, on one toy net:

* sync PS with 2 servers (ranks 0, 1) and 2 workers == DistributedDataParallel on the workers, after k steps;
  the bytes through each server sum to the parameter-server formula of notebook 01 (the schedule's count);
* a stop signal mid-epoch under sync PS with 2 servers: every rank stops after the same step, checkpoints,
  and the resumed run ends bit-identical (weights and the servers' momentum) to the uninterrupted one;
* async with one worker (3 servers) is sync, bit for bit;
* with 1 server and 3 workers, rank 3 a straggler held back by an order of events (not a clock): in SSP the
  fast workers get K clocks ahead and no further, and the staleness is bounded; in async they make the first
  12 updates without it and its first gradient is applied 12 versions stale;
* a stop signal mid-epoch under async is honoured at the end of the epoch, by every rank;
* SSP on real digits at the rate and momentum that stalled before (lr 0.05, momentum 0.9) learns: the loss
  stays finite and falls epoch after epoch.

A 2-rank spawn checks that a dead worker stops the server with a clear error.
"""
import contextlib
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.collectives import get_schedule
from labkit.collectives.simulate import count
from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.lab.ps import compare_modes
from labkit.optim import OptimizerSpec
from labkit.strategies.ps.server import PeerFailure, ServerState, wait
from labkit.strategies.ps.strategy import ParameterServerStrategy
from labkit.train.checkpoint import load_training_state, save_training_state
from labkit.train.loop import fit
from labkit.train.preempt import Preempted, StopSignals

STEPS, BATCH, LR = 3, 4, 0.1


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class StopAt(StopSignals):
    """A stop signal that is there from the ``call``-th time the loop looks at ``received`` (``labkit train``'s
    StopSignals, asking after every step: ``every_steps=1``). With 3 steps an epoch the loop looks when it
    launches the check after step 0 and when it asks after the epoch."""

    def __init__(self, call: int | None):
        self.call, self.calls = call, 0
        super().__init__(every_steps=1)

    @property
    def received(self) -> str | None:
        self.calls += 1
        return "SIGTERM" if self.call is not None and self.calls >= self.call else None

    @received.setter
    def received(self, value) -> None:
        pass  # the signal comes from `call` alone


def train_ps(env, mode, steps=STEPS, epochs=1, out=None, stop_call=None, resume=False, **options):
    """fit() under --strategy ps as ``labkit train`` runs it (checkpoint per epoch and on a stop signal);
    returns (flat weights, the records, the optimizer's momentum buffers), or ("stopped", epoch, step)."""
    strategy = ParameterServerStrategy(env, {"ps_mode": mode, "ps_timeout_s": 30, **options})
    model = strategy.prepare(net())
    optimizer, _ = strategy.build_optimizer(model, OptimizerSpec("sgd", LR, 0.9, env=env))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = DataLoader(data(), BATCH, sampler=strategy.sampler(data(), True, seed=1), drop_last=True)
    path = strategy.checkpoint_file(out) if out else None

    def save(epochs_done, position=None):
        if path:
            save_training_state(path, strategy, model, optimizer, scheduler, None,
                                {"epoch": epochs_done, "position": position}, {})
    start, position = 0, None
    if resume:
        state = load_training_state(path, strategy, model, optimizer, scheduler, None)
        start, position = state["epoch"], state["position"]
    try:
        fit(model, loader, None, optimizer, epochs=epochs, strategy=strategy, max_steps=steps, seed=1,
            printer=lambda *_: None, stop=StopAt(stop_call), on_stop=save, start_epoch=start, position=position,
            on_epoch_end=lambda epoch: save(epoch + 1))
    except Preempted as stopped:
        return "stopped", stopped.epoch, stopped.step
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters() if p in optimizer.state]
    return nn.utils.parameters_to_vector(model.parameters()).detach(), strategy.records(), momentum


def ddp_on(env, workers, epochs):
    """The reference: DDP over the worker ranks, same shards (DistributedSampler, seed 1), same SGD."""
    group = dist.new_group(workers)
    if env.rank not in workers:
        return None
    model = net()
    ddp = DistributedDataParallel(model, process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sampler = DistributedSampler(data(), num_replicas=len(workers), rank=workers.index(env.rank), shuffle=True,
                                 seed=1, drop_last=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step, (x, y) in zip(range(STEPS), DataLoader(data(), BATCH, sampler=sampler, drop_last=True)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
    return nn.utils.parameters_to_vector(model.parameters()).detach()


@contextlib.contextmanager
def straggler_gate(env, gate: Path, mode: str):
    """Rank 3 (a worker) waits before its first step until the server opens ``gate``: a straggler whose delay
    is an order of events, not a duration. The server (rank 0) opens it in async mode after update 12 and takes
    rank 3's push next; in ssp mode once both fast workers are held, K = 1 clocks ahead of rank 3."""
    saved = ParameterServerStrategy.forward_backward, ServerState.receive, ServerState.after_step
    if env.rank == 3:
        def gated_forward_backward(self, *args):
            while not gate.exists():  # waiting for an event; the run's timeout bounds it
                time.sleep(0.005)
            return saved[0](self, *args)
        ParameterServerStrategy.forward_backward = gated_forward_backward
    elif env.rank == 0 and mode == "async":
        def receive(self, count):
            if self.version == 12 and not gate.exists():
                gate.touch()
                buf = torch.empty(self.numel, dtype=self.params[0].dtype)
                wait(dist.irecv(buf, src=3), 60, "the straggler's first push")
                return [(3, buf)]
            return saved[1](self, count)
        ServerState.receive = receive
    elif env.rank == 0:
        def after_step(self, budget_reached):
            saved[2](self, budget_reached)
            if sorted(self.held) == [1, 2]:
                gate.touch()
        ServerState.after_step = after_step
    try:
        yield
    finally:
        ParameterServerStrategy.forward_backward, ServerState.receive, ServerState.after_step = saved


def four_ranks(env, out):
    two_servers = {"ps_servers": 2}
    res = {"sync": train_ps(env, "sync", epochs=2, **two_servers), "ddp": ddp_on(env, [2, 3], epochs=2)}
    # looks 1-2 in epoch 1, 3 when epoch 2's check after step 0 is launched: read after step 1, it stops every rank
    # after step 2
    res["stopped"] = train_ps(env, "sync", epochs=2, out=out, stop_call=3 if env.rank == 3 else None, **two_servers)
    res["resumed"] = train_ps(env, "sync", epochs=2, out=out, resume=True, **two_servers)
    one_worker = {"ps_servers": 3}
    res["1w-sync"] = train_ps(env, "sync", steps=4, epochs=2, **one_worker)[0]
    res["1w-async"] = train_ps(env, "async", steps=4, epochs=2, **one_worker)[0]
    with straggler_gate(env, Path(out + "-ssp-gate"), "ssp"):
        res["ssp"] = train_ps(env, "ssp", steps=24, max_staleness=1)
    with straggler_gate(env, Path(out + "-async-gate"), "async"):
        res["async"] = train_ps(env, "async", steps=24)
    res["async-stopped"] = train_ps(env, "async", steps=12, epochs=2, out=out + "-async",
                                    stop_call=2 if env.rank == 2 else None)
    res["digits"] = compare_modes(env, ("ssp",), epochs=2, train_size=1024, test_size=250, lr=0.05, momentum=0.9,
                                  max_staleness=1, model="mlp")["ssp"]["history"]
    return res


def test_ps_sync_is_ddp_resumes_bit_identically_and_async_ssp_record_staleness(one_thread, tmp_path):
    per_rank = run_ranks(four_ranks, 4, str(tmp_path / "ckpt"), timeout=300)
    _check_sync_is_ddp_and_counts_the_formulas_bytes(per_rank)
    _check_sync_stop_resumes_bit_identically(per_rank, tmp_path)
    for r in range(4):  # one worker: async is sync
        assert torch.equal(per_rank[r]["1w-sync"], per_rank[r]["1w-async"])
    _check_ssp_bounds_the_clocks(per_rank)
    _check_async_does_not_wait_for_the_straggler(per_rank)
    # async: rank 2's signal in epoch 1 stops every rank at the end of that epoch, after its checkpoint
    assert [per_rank[r]["async-stopped"] for r in range(4)] == [("stopped", 1, 0)] * 4
    assert (tmp_path / "ckpt-async" / "checkpoint.pt").exists()
    losses = [e["train_loss"] for e in per_rank[0]["digits"]]
    assert all(math.isfinite(x) for x in losses) and losses[1] < 0.8 * losses[0] < 0.8 * math.log(10), losses


def _check_sync_is_ddp_and_counts_the_formulas_bytes(per_rank):
    sync_weights, sync_record, _ = per_rank[0]["sync"]
    for r in range(4):  # every rank holds the servers' model after the epoch
        assert torch.equal(per_rank[r]["sync"][0], sync_weights)
    torch.testing.assert_close(sync_weights, per_rank[2]["ddp"], rtol=0, atol=1e-6)
    assert not torch.equal(sync_weights, nn.utils.parameters_to_vector(net().parameters()).detach())
    servers = sync_record["per_server"]
    assert [[u["version"] for u in s["updates"]] for s in servers] == [[1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]] * 2
    assert all(u["staleness"] == 0 for s in servers for u in s["updates"])
    # notebook 01: with W workers each server receives and sends W × its shard per step; the shards add up to
    # the one-server count of the parameter-server schedule, W n
    n = sum(p.numel() for p in net().parameters())
    formula = count(get_schedule("parameter-server", 3), n)
    assert formula.elements_recv[0] == formula.elements_sent[0] == 2 * n
    assert sum(s["bytes"]["received"] for s in servers) == 2 * STEPS * formula.elements_recv[0] * 4
    assert sum(s["bytes"]["sent"] for s in servers) == 2 * STEPS * formula.elements_sent[0] * 4
    assert [s["numel"] for s in servers] == [6 * 8, 8 + 8 * 3 + 3]  # whole tensors, largest first


def _check_sync_stop_resumes_bit_identically(per_rank, tmp_path):
    """Stopped mid-epoch 2 after step 2 on every rank; each rank wrote its own file (two servers: two shards)."""
    assert [per_rank[r]["stopped"] for r in range(4)] == [("stopped", 1, 2)] * 4
    assert sorted(p.name for p in tmp_path.glob("ckpt/checkpoint*.pt")) == [f"checkpoint.rank{r}.pt" for r in range(4)]
    for r in range(4):
        weights, _, momentum = per_rank[r]["resumed"]
        assert torch.equal(weights, per_rank[0]["sync"][0])
        assert len(momentum) == len(per_rank[r]["sync"][2])
        assert all(torch.equal(a, b) for a, b in zip(momentum, per_rank[r]["sync"][2]))
    assert [len(per_rank[r]["sync"][2]) for r in range(4)] == [1, 3, 0, 0]  # momentum lives on the servers


def _check_ssp_bounds_the_clocks(per_rank):
    """Rank 3 held back until both fast workers are a clock ahead: K = 1 binds, and it bounds the staleness."""
    ssp = per_rank[0]["ssp"][1]["per_server"][0]["updates"]
    assert len(ssp) == 24
    assert [next(u["ahead"] for u in ssp if u["worker"] == w) for w in (1, 2)] == [1, 1]  # their first updates
    assert max(u["ahead"] for u in ssp if u["ahead"] is not None) == 1
    assert max(u["staleness"] for u in ssp) <= (3 - 1) * (2 * 1 + 1)  # (W-1)(2K+1)
    for r in range(4):
        assert torch.equal(per_rank[r]["ssp"][0], per_rank[0]["ssp"][0])


def _check_async_does_not_wait_for_the_straggler(per_rank):
    """The fast workers make the first 12 updates while rank 3 has pushed nothing; its first gradient, from the
    starting weights, is applied 12 versions stale."""
    updates = per_rank[0]["async"][1]["per_server"][0]["updates"]
    assert len(updates) == 24 and [u["version"] for u in updates] == list(range(1, 25))
    assert {u["worker"] for u in updates[:12]} == {1, 2}
    assert (updates[12]["worker"], updates[12]["staleness"]) == (3, 12)


def dead_worker(env):
    if env.rank == 1:  # the worker dies after its second push
        original = ParameterServerStrategy.sync_gradients
        calls = [0]

        def sync_then_die(self, model):
            original(self, model)
            calls[0] += 1
            if calls[0] == 2:
                os._exit(1)
        ParameterServerStrategy.sync_gradients = sync_then_die
    last_push = [time.monotonic()]
    receive = ServerState.receive

    def timed_receive(self, count):
        got = receive(self, count)
        last_push[0] = time.monotonic()
        return got
    ServerState.receive = timed_receive
    try:
        return train_ps(env, "async", steps=6, ps_timeout_s=3)
    except PeerFailure as exc:
        raise PeerFailure(f"after {time.monotonic() - last_push[0]:.1f} s: {exc}") from None


def test_a_dead_worker_is_a_clear_error(one_thread):
    with pytest.raises(RuntimeError) as failure:
        run_ranks(dead_worker, 2, timeout=120)
    found = re.search(r"PeerFailure: after ([0-9.]+) s: server rank 0 waiting for a push from workers \[1\]: "
                      r"nothing arrived within 3 s \(--ps-timeout-s\) or the peer died", str(failure.value))
    assert found, str(failure.value)[-2000:]
    # the server notices the dead peer --ps-timeout-s after the last push it received
    assert float(found[1]) < 3 + 6


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
    with pytest.raises(ConfigError, match="--ps-momentum 0.5: it applies to --ps-mode async or ssp"):
        ParameterServerStrategy(env, {"ps_momentum": 0.5})
    with pytest.raises(ConfigError, match="--ps-record /proc/labkit/record.json: cannot write /proc/labkit"):
        ParameterServerStrategy(env, {"ps_record": "/proc/labkit/record.json"})


def test_async_servers_take_off_the_momentum_asynchrony_adds():
    """μ − (1 − 1/W), at least 0: 0.9 − 1/2 = 0.4 with 2 workers, 0.9 − 2/3 with 3, 0 with 11 (10 workers)."""
    def momentum(world, mode="async", **options):
        strategy = ParameterServerStrategy(DistEnv(rank=1, world_size=world), {"ps_mode": mode, **options})
        return strategy.server_momentum(0.9)
    assert momentum(3) == pytest.approx(0.4) and momentum(4, "ssp") == pytest.approx(0.9 - 2 / 3)
    assert momentum(11) == 0.0 and momentum(2) == 0.9  # one worker: nothing implicit
    assert momentum(3, ps_momentum=0.7) == 0.7


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

"""labkit.parallel.ddp: DDP on W gloo ranks == one process on the global batch; every --allreduce
algorithm == DDP's gradients; sampler shards; bad input.

Tolerances (float32, tiny MLP): loss and gradients after one step within 1e-6 absolute (the sums are
only reordered); weights after 6 momentum-SGD steps within 1e-5.
"""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from labkit.cli import main as cli_main
from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.parallel.data_parallel import ShardSampler
from labkit.parallel.ddp import DDPStrategy, check_against_ddp, parse_kill_at
from labkit.parallel.dp import ALLREDUCE_MODES

B, EPOCHS, STEPS_PER_EPOCH, SEED, LR = 4, 2, 3, 5, 0.1


def _data(world_size: int):
    g = torch.Generator().manual_seed(0)
    n = STEPS_PER_EPOCH * world_size * B + 1  # one left over: dropped so no sample repeats
    train = TensorDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 5, (n,), generator=g))
    test = TensorDataset(torch.randn(10, 1, 4, 4, generator=g), torch.randint(0, 5, (10,), generator=g))
    return train, test  # 10 test samples: not divisible by 3, so the eval shards are uneven


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 5))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _ddp_rank(env):
    """On every rank: DDP training for EPOCHS epochs, then each hand-made all-reduce for one step."""
    from labkit.train.loop import evaluate

    train, test = _data(env.world_size)
    strategy = DDPStrategy(env, {"allreduce": "ddp"})
    model = strategy.prepare(_model())
    loader = DataLoader(train, batch_size=B, sampler=strategy.sampler(train, True, SEED), drop_last=True)
    opt = torch.optim.SGD(strategy.unwrap(model).parameters(), lr=LR, momentum=0.9)
    losses, first_grads = [], None
    for epoch in range(EPOCHS):
        strategy.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss, _ = strategy.forward_backward(model, x, y, nn.CrossEntropyLoss())
            strategy.sync_gradients(model)
            first_grads = first_grads or _grads(strategy.unwrap(model))
            losses.append(loss)
            opt.step()
    test_loader = DataLoader(test, batch_size=3, sampler=strategy.sampler(test, False, SEED))
    metrics = evaluate(model, test_loader, strategy, nn.CrossEntropyLoss())
    weights = [p.detach().clone() for p in strategy.unwrap(model).parameters()]

    # each hand-made mode, one step on the first batch of epoch 0, against DDP's first-step gradients
    hand = {}
    for mode in ALLREDUCE_MODES[1:]:
        hs = DDPStrategy(env, {"allreduce": mode, "bucket_mb": 0.0005})  # ~500 B: several buckets
        hm = hs.prepare(_model())
        sampler = hs.sampler(train, True, SEED)
        hs.set_epoch(0)
        x, y = next(iter(DataLoader(train, batch_size=B, sampler=sampler)))
        hs.forward_backward(hm, x, y, nn.CrossEntropyLoss())
        hs.sync_gradients(hm)
        hand[mode] = max((a - b).abs().max().item() for a, b in zip(_grads(hm), first_grads, strict=True))
    return dict(losses=torch.stack(losses), grads=first_grads, weights=weights, metrics=metrics, hand=hand,
                check_native=check_against_ddp(env, "native"), fit=_fit_ddp(env))


def _fit_ddp(env) -> tuple[list[dict], list[torch.Tensor]]:
    """The loop users run: labkit.train.loop.fit with the DDP strategy; its epoch records and final weights."""
    from labkit.train.loop import fit

    train, test = _data(env.world_size)
    strategy = DDPStrategy(env, {"allreduce": "ddp"})
    model = strategy.prepare(_model())
    opt = torch.optim.SGD(strategy.unwrap(model).parameters(), lr=LR, momentum=0.9)
    history = fit(model, DataLoader(train, batch_size=B, sampler=strategy.sampler(train, True, SEED), drop_last=True),
                  DataLoader(test, batch_size=3, sampler=strategy.sampler(test, False, SEED)), opt, epochs=EPOCHS,
                  strategy=strategy, seed=SEED, printer=lambda line: None)
    return history, [p.detach().clone() for p in strategy.unwrap(model).parameters()]


def _fit_single(world_size: int) -> tuple[list[dict], list[torch.Tensor]]:
    """fit in one process on the global batch (world_size × B), drawn in the ranks' shuffled order: a one-replica
    DistributedSampler with the same seed permutes the same way, and global batch s is the ranks' batches s."""
    from torch.utils.data.distributed import DistributedSampler

    from labkit.train.loop import fit

    train, test = _data(world_size)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    history = fit(model, DataLoader(train, batch_size=world_size * B, sampler=sampler, drop_last=True),
                  DataLoader(test, batch_size=3), opt, epochs=EPOCHS, seed=SEED, printer=lambda line: None)
    return history, [p.detach().clone() for p in model.parameters()]


def _single_reference(world_size: int):
    """One process, global batch of world_size × B, in DistributedSampler's order (seed + epoch)."""
    train, test = _data(world_size)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    g_batch = world_size * B
    losses, first_grads = [], None
    for epoch in range(EPOCHS):
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        for s in range(STEPS_PER_EPOCH):
            x, y = train[order[s * g_batch:(s + 1) * g_batch]]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            first_grads = first_grads or _grads(model)
            losses.append(loss.detach())
            opt.step()
    with torch.no_grad():
        out = model(test.tensors[0])
        metrics = (nn.functional.cross_entropy(out, test.tensors[1]).item(),
                   (out.argmax(1) == test.tensors[1]).sum().item() / len(test))
    return dict(losses=torch.stack(losses), grads=first_grads, weights=list(model.parameters()), metrics=metrics)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_equals_single_process_on_the_global_batch(world_size):
    ranks = run_ranks(_ddp_rank, world_size, timeout=300)
    ref = _single_reference(world_size)
    # the global-batch loss is the mean of the per-rank mean losses (equal shard sizes)
    mean_loss = torch.stack([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(mean_loss, ref["losses"], atol=1e-6, rtol=1e-5)
    for r in ranks:
        for got, want in zip(r["grads"], ref["grads"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        for got, want in zip(r["weights"], ref["weights"], strict=True):
            torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-4)
        # uneven evaluation shards, no padding: every test sample counted exactly once
        assert r["metrics"][0] == pytest.approx(ref["metrics"][0], abs=1e-5)
        assert r["metrics"][1] == pytest.approx(ref["metrics"][1], abs=1e-9)
        assert set(r["hand"]) == set(ALLREDUCE_MODES[1:])
        for mode, diff in r["hand"].items():
            assert diff <= 1e-6, f"--allreduce {mode} differs from DDP by {diff} on {world_size} ranks"
        assert r["check_native"] <= 1e-6
    # the same through fit(), the loop `labkit train` runs: every epoch record and the final weights
    single_history, single_weights = _fit_single(world_size)
    for r in ranks:
        history, weights = r["fit"]
        for got, want in zip(history, single_history, strict=True):
            for key in ("train_loss", "test_loss"):
                assert got[key] == pytest.approx(want[key], abs=1e-5), (key, got["epoch"])
            for key in ("train_acc", "test_acc"):
                assert got[key] == want[key], (key, got["epoch"])
        for got, want in zip(weights, single_weights, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # replicas stay identical
    for r in ranks[1:]:
        for a, b in zip(r["weights"], ranks[0]["weights"], strict=True):
            assert torch.equal(a, b)


def _env(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, local_world_size=world_size, backend="gloo", distributed=True)


@pytest.mark.parametrize("n, world_size", [(12, 3), (10, 3), (9, 2)])
def test_sampler_shards_are_disjoint_and_cover_the_data(n, world_size):
    data = TensorDataset(torch.arange(n))
    train = [list(DDPStrategy(_env(r, world_size)).sampler(data, True, seed=0)) for r in range(world_size)]
    flat = [i for shard in train for i in shard]
    assert len(set(flat)) == len(flat)  # disjoint: no sample on two ranks, none repeated
    assert len({len(s) for s in train}) == 1  # equal shards: the ranks step in lock-step
    assert len(flat) == n - n % world_size  # covering, except the n mod W left over (drop_last)
    test = [list(DDPStrategy(_env(r, world_size)).sampler(data, False, seed=0)) for r in range(world_size)]
    assert sorted(i for shard in test for i in shard) == list(range(n))  # evaluation: exactly once each
    assert all(isinstance(DDPStrategy(_env(r, world_size)).sampler(data, False, 0), ShardSampler)
               for r in range(world_size))


def test_set_epoch_reshuffles_the_same_way_on_every_rank():
    data = TensorDataset(torch.arange(40))
    orders = {}
    for rank in range(2):
        strategy = DDPStrategy(_env(rank, 2))
        sampler = strategy.sampler(data, True, seed=0)
        for epoch in range(2):
            strategy.set_epoch(epoch)
            orders[rank, epoch] = list(sampler)
    assert orders[0, 0] != orders[0, 1]
    for epoch in range(2):  # the ranks split one shared permutation: still disjoint after set_epoch
        assert not set(orders[0, epoch]) & set(orders[1, epoch])
    again = DDPStrategy(_env(0, 2))
    sampler = again.sampler(data, True, seed=0)
    again.set_epoch(1)
    assert list(sampler) == orders[0, 1]  # deterministic: a resumed run sees the same order


def test_per_rank_and_global_batch():
    assert DDPStrategy(_env(0, 4)).data_parallel_size == 4
    assert DDPStrategy(_env(0, 4), {"global_batch_size": 256}).per_rank_batch_size(64) == 64
    assert DDPStrategy(_env(0, 4), {"global_batch_size": 512}).per_rank_batch_size(64) == 128
    assert DDPStrategy(_env(0, 4)).per_rank_batch_size(32) == 32


def test_bad_input_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"--global-batch-size 10 cannot be split evenly over 4 ranks; "
                                          r"use a multiple of 4 \(e.g. 8 or 12\)"):
        DDPStrategy(_env(0, 4), {"global_batch_size": 10})
    with pytest.raises(ConfigError, match="--global-batch-size must be > 0, got 0"):
        DDPStrategy(_env(0, 2), {"global_batch_size": 0})
    with pytest.raises(ConfigError, match="the training set has 3 samples but the job has 4 ranks"):
        DDPStrategy(_env(0, 4)).sampler(TensorDataset(torch.arange(3)), True, seed=0)
    with pytest.raises(ConfigError, match="unknown --allreduce 'rng'; choose one of ddp, native, ring"):
        DDPStrategy(_env(0, 2), {"allreduce": "rng"})
    with pytest.raises(ConfigError, match="--bucket-mb must be > 0"):
        DDPStrategy(_env(0, 2), {"bucket_mb": -1})
    with pytest.raises(ConfigError, match="--kill-rank-at '1-6' is not RANK:STEP"):
        parse_kill_at("1-6")
    assert parse_kill_at(" 1:6") == (1, 6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_nccl_on_cpu_exits_2_with_one_line(capsys):
    assert cli_main(["train", "--strategy", "ddp", "--device", "cpu", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("labkit: error: backend nccl needs GPUs")


def test_bench_scaling_math_and_plot(tmp_path):
    from labkit.bench.ddp import parse_ranks, plot_scaling, scaling_rows

    assert parse_ranks("4, 1,2") == [1, 2, 4]
    with pytest.raises(ConfigError, match="--ranks '1,x' is not a comma list"):
        parse_ranks("1,x")
    with pytest.raises(ConfigError, match="needs rank counts >= 1"):
        parse_ranks("0,2")
    rows = scaling_rows({1: 100.0, 2: 180.0, 4: 300.0})
    assert [(r["ranks"], r["speedup"], r["efficiency"]) for r in rows] == [(1, 1.0, 1.0), (2, 1.8, 0.9),
                                                                          (4, 3.0, 0.75)]
    assert scaling_rows({2: 100.0, 4: 150.0})[1]["efficiency"] == 0.75  # relative to the smallest count
    plot_scaling(rows, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""labkit.strategies.mesh on gloo CPU ranks: every composition, through the same ``labkit.train.fit`` a user runs,
equals single-process ``fit`` on the global batch; mesh checkpoints resume bit-identically; another mesh is
refused on resume.

One 2-rank spawn runs several fits in turn: a CNN on ``--mesh dp=2`` (replicas + bucketed all-reduce) and on
``dp=2 --dp-shard fsdp`` (FSDP2 over the mesh's dp group). Tolerances (float32): the loss of every step within
1e-6 absolute (only the order of the sums changes), the weights after 6 momentum-SGD steps within 1e-5; a
resumed run's weights are bit-identical (==) to the run that was not interrupted.
"""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.dist import DistEnv
from labkit.errors import CheckpointError
from labkit.strategies.base import Strategy
from labkit.testing import run_ranks

B, EPOCHS, STEPS, SEED, LR = 4, 2, 3, 5, 0.1
RANKS = 2


def _data():
    g = torch.Generator().manual_seed(0)
    n = STEPS * RANKS * B
    train = TensorDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 5, (n,), generator=g))
    test = TensorDataset(torch.randn(6, 1, 4, 4, generator=g), torch.randint(0, 5, (6,), generator=g))
    return train, test


def _cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 5))


def _recorded(strategy: Strategy) -> list[torch.Tensor]:
    """Record the loss of every step the loop runs (the loss ``forward_backward`` returns)."""
    losses, inner = [], strategy.forward_backward

    def forward_backward(*args):
        loss, out = inner(*args)
        losses.append(loss.clone())
        return loss, out

    strategy.forward_backward = forward_backward
    return losses


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _fit(strategy, model, epochs=EPOCHS, start_epoch=0, out=None, resume=False):
    """labkit.train.fit as ``labkit train`` calls it; with ``out``: save (or resume from) a checkpoint there."""
    from labkit.checkpoint import load_training_state, save_training_state
    from labkit.train import fit

    train, test = _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if resume:
        load_training_state(strategy.checkpoint_file(out), strategy, model, optimizer, scheduler, None)
    losses = _recorded(strategy)
    sampler = strategy.sampler(train, True, SEED)
    fit(model, DataLoader(train, batch_size=len(train) // STEPS // strategy.data_parallel_size, sampler=sampler,
                          drop_last=True),
        DataLoader(test, batch_size=3, sampler=strategy.sampler(test, False, SEED)), optimizer, epochs=epochs,
        start_epoch=start_epoch, strategy=strategy, seed=SEED, scheduler=scheduler, printer=lambda line: None)
    if out is not None and not resume:
        save_training_state(strategy.checkpoint_file(out), strategy, model, optimizer, scheduler, None,
                            {"epoch": epochs}, {})
    return losses


def _single() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The oracle: one process, the global batch, drawn in the ranks' order (a one-replica DistributedSampler
    with the same seed permutes the same way, so global batch s is the ranks' batches s)."""
    from labkit.train import fit

    train, test = _data()
    model = _cnn()
    strategy = Strategy(DistEnv())
    losses = _recorded(strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    fit(model, DataLoader(train, batch_size=RANKS * B, sampler=sampler, drop_last=True), DataLoader(test, batch_size=3),
        optimizer, epochs=EPOCHS, strategy=strategy, seed=SEED, printer=lambda line: None)
    return torch.stack(losses), _weights(model)


def _two_ranks(env, out):
    """On each of 2 ranks: the CNN on dp=2 and on dp=2 --dp-shard fsdp; an fsdp run cut after one epoch and
    resumed; that checkpoint offered to a run on another mesh."""
    from labkit.strategies.mesh import MeshStrategy

    result = {}
    for key, options in {"dp": {"mesh": "dp=2"}, "fsdp": {"mesh": "dp=2", "dp_shard": "fsdp"}}.items():
        strategy = MeshStrategy(env, options)
        model = strategy.prepare(_cnn())
        losses = _fit(strategy, model)
        result[key] = dict(losses=torch.stack(losses), weights=_weights(model), data=strategy.data_shard(),
                           owner=strategy.metric_owner())
    fsdp = {"mesh": "dp=2", "dp_shard": "fsdp"}
    first = MeshStrategy(env, fsdp)
    _fit(first, first.prepare(_cnn()), epochs=1, out=out)
    again = MeshStrategy(env, fsdp)
    model = again.prepare(_cnn())
    _fit(again, model, start_epoch=1, out=out, resume=True)
    result["resumed"] = _weights(model)
    other = MeshStrategy(env, {"mesh": "dp=2"})
    try:
        _fit(other, other.prepare(_cnn()), start_epoch=1, out=out, resume=True)
    except CheckpointError as exc:
        result["mismatch"] = str(exc)
    return result


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_two_ranks, RANKS, str(tmp_path_factory.mktemp("mesh")))


def _check_equal(ranks, key, single_losses, single_weights):
    """Each step's global loss (the mean of the data shards' losses) and the final weights equal the oracle's."""
    assert sorted(r[key]["data"] for r in ranks) == [(2, 0), (2, 1)]
    assert all(r[key]["owner"] for r in ranks)
    losses = torch.stack([r[key]["losses"] for r in ranks]).mean(0)
    assert losses.shape == (EPOCHS * STEPS,)
    torch.testing.assert_close(losses, single_losses, rtol=0, atol=1e-6)
    for r in ranks:
        for w, s in zip(r[key]["weights"], single_weights, strict=True):
            torch.testing.assert_close(w, s, rtol=0, atol=1e-5)


@pytest.mark.parametrize("key", ["dp", "fsdp"])
def test_cnn_on_dp2_equals_one_process(two, key):
    single_losses, single_weights = _single()
    _check_equal(two, key, single_losses, single_weights)


def test_mesh_checkpoint_resumes_bit_identically_and_another_mesh_is_refused(two):
    for r in two:
        for w, s in zip(r["resumed"], r["fsdp"]["weights"], strict=True):
            assert torch.equal(w, s)
        assert "--mesh dp=2 --dp-shard fsdp" in r["mismatch"] and "this run has --mesh dp=2;" in r["mismatch"]

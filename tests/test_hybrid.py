"""The seed-000 hybrid strategy: one step on 2 gloo ranks == one single-process step on the whole batch (loss,
logits, every gradient); three steps (the last with uneven shards) == the same weights; the per-rank
checkpoint contents; `labkit train --strategy hybrid` on 2 ranks; bad models."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from labkit.dist.group import DistEnv
from labkit.dist.testing import run_cli_ranks, run_ranks
from labkit.errors import ConfigError
from labkit.models.cnn import get_model
from labkit.strategies.hybrid import HybridStrategy

ATOL = 1e-5  # float32: the convolutions run per shard, the sums run in another order
SHARDS = [(4, 4), (4, 4), (3, 5)]  # rows per rank at each step; the last step exercises the padding


def _model() -> nn.Module:
    torch.manual_seed(0)
    return get_model("alexnet_small", num_classes=10, in_channels=3, image_size=16)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _hybrid_rank(env) -> dict:
    strategy = HybridStrategy(env)
    model = strategy.prepare(_model())
    optimizer = torch.optim.SGD(strategy.unwrap(model).parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    result = {}
    for step, sizes in enumerate(SHARDS):
        x, y = _batch(step)
        start = sum(sizes[:env.rank])
        x, y = x[start:start + sizes[env.rank]], y[start:start + sizes[env.rank]]
        optimizer.zero_grad(set_to_none=True)
        loss, out = strategy.forward_backward(model, x, y, criterion)
        strategy.sync_gradients(model)
        if step == 0:
            result.update(loss=loss, logits=out, grads=_grads(model))
        optimizer.step()
    result["weights"] = {k: v.clone() for k, v in strategy.unwrap(model).state_dict().items()}
    x, _ = _batch(0)
    result["eval"] = strategy.forward(model, x)
    result["fit"] = _fit(HybridStrategy(env), 4)
    return result


def _fit_data():
    g = torch.Generator().manual_seed(7)
    train = torch.utils.data.TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))
    test = torch.utils.data.TensorDataset(torch.randn(6, 3, 16, 16, generator=g), torch.randint(0, 10, (6,), generator=g))
    return train, test


def _fit(strategy, batch: int, sampler=None) -> tuple[list[dict], dict]:
    """Two epochs of two steps through labkit.train.loop.fit (the loop `labkit train` runs): records, final weights."""
    from torch.utils.data import DataLoader

    from labkit.train.loop import fit

    train, test = _fit_data()
    model = strategy.prepare(_model())
    optimizer = torch.optim.SGD(strategy.unwrap(model).parameters(), lr=0.01, momentum=0.9)
    history = fit(model, DataLoader(train, batch_size=batch, sampler=sampler or strategy.sampler(train, True, 3),
                                    drop_last=True),
                  DataLoader(test, batch_size=4), optimizer, epochs=2, strategy=strategy, seed=3,
                  printer=lambda line: None)
    return history, {k: v.clone() for k, v in strategy.unwrap(model).state_dict().items()}


def _single() -> dict:
    model, criterion = _model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    result = {}
    for step in range(len(SHARDS)):
        x, y = _batch(step)
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        loss = criterion(out, y)
        loss.backward()
        if step == 0:
            result.update(loss=loss.detach(), logits=out.detach(), grads=_grads(model))
        optimizer.step()
    result["weights"] = model.state_dict()
    result["eval"] = model(_batch(0)[0]).detach()
    return result


def test_hybrid_equals_single_process():
    ranks, single = run_ranks(_hybrid_rank, 2, timeout=120), _single()
    b = SHARDS[0][0]
    # each rank gets back the logits of its own rows; its loss is the mean over them
    assert torch.allclose(torch.cat([r["logits"] for r in ranks]), single["logits"], atol=ATOL)
    assert ((ranks[0]["loss"] + ranks[1]["loss"]) / 2).item() == pytest.approx(single["loss"].item(), abs=ATOL)
    assert set(ranks[0]["grads"]) == set(single["grads"])  # rank 0: every parameter
    assert set(ranks[1]["grads"]) == {k for k in single["grads"] if k.startswith("features.")}
    for rank, r in enumerate(ranks):
        for name, grad in r["grads"].items():
            assert torch.allclose(grad, single["grads"][name], atol=ATOL), (rank, name)
        for name, weight in r["weights"].items():  # three SGD steps later
            assert torch.allclose(weight, single["weights"][name], atol=ATOL), (rank, name)
    assert len(ranks[0]["weights"]) == len(single["weights"])  # rank 0's checkpoint: the whole model
    assert torch.allclose(ranks[0]["eval"], single["eval"], atol=ATOL)  # evaluation: rank 0 alone
    assert ranks[1]["eval"] is None
    assert ranks[0]["logits"].shape == (b, 10)
    _check_fit_equals_single_process_fit(ranks)


def _check_fit_equals_single_process_fit(ranks: list[dict]) -> None:
    """The same through fit(): a one-replica DistributedSampler with the same seed permutes the training set the
    way the ranks' samplers do, so its global batch s holds the ranks' batches s."""
    from torch.utils.data.distributed import DistributedSampler

    from labkit.strategies.base import Strategy

    train, _ = _fit_data()
    history, weights = _fit(Strategy(DistEnv()), 8, DistributedSampler(train, num_replicas=1, rank=0, seed=3))
    for r in ranks:
        got_history, got_weights = r["fit"]
        for got, want in zip(got_history, history, strict=True):
            for key in ("train_loss", "test_loss"):
                assert got[key] == pytest.approx(want[key], abs=ATOL), (key, got["epoch"])
            assert got["train_acc"] == want["train_acc"] and got["test_acc"] == want["test_acc"]
        for name, weight in got_weights.items():
            assert torch.allclose(weight, weights[name], atol=ATOL), name


def test_hybrid_needs_features_and_classifier():
    strategy = HybridStrategy(DistEnv())
    with pytest.raises(ConfigError, match=r"needs a model with \.features .* use --model alexnet_small"):
        strategy.prepare(get_model("mlp"))
    with pytest.raises(ConfigError, match="classifier has no nn.Linear"):
        model = _model()
        model.classifier = nn.Sequential(nn.Identity())
        strategy.prepare(model)


def test_hybrid_on_one_process_is_the_plain_model():
    strategy = HybridStrategy(DistEnv())
    model = strategy.prepare(_model())
    reference = copy.deepcopy(model)
    x, y = _batch(0)
    _loss, out = strategy.forward_backward(model, x, y, nn.CrossEntropyLoss())
    assert torch.allclose(out, reference(x), atol=ATOL) and strategy.sampler([0, 1], True, 0) is None


def test_labkit_train_hybrid_on_two_ranks(tmp_path):
    """The ``labkit train`` command's whole path on two ranks set up as torchrun sets them up (forked: the
    launcher itself is tests/test_launch.py's)."""
    ranks = run_cli_ranks(["train", "--strategy", "hybrid", "--model", "alexnet_small", "--dataset",
                           "synthetic-cifar10", "--train-size", "64", "--test-size", "32", "--batch-size", "16",
                           "--epochs", "1", "--device", "cpu", "--out", str(tmp_path)], 2, timeout=300)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    log = "".join(out + err for _, out, err in ranks)
    assert "samples/sec" in log and "CPU (process" in log
    metrics = json.loads((tmp_path / "summary.json").read_text())["metrics"]
    assert metrics["global_batch_size"] == 32 and metrics["samples_per_sec"] > 0
    assert 0.0 <= metrics["final_test_acc"] <= 1.0
    rank0 = torch.load(tmp_path / "checkpoint.rank0.pt", weights_only=True)["model"]
    rank1 = torch.load(tmp_path / "checkpoint.rank1.pt", weights_only=True)["model"]
    assert set(rank1) == {k for k in rank0 if k.startswith("features.")}
    for k, v in rank1.items():  # the replicated convolutions stayed identical
        assert torch.equal(v, rank0[k]), k
    single = get_model("alexnet_small", num_classes=10, in_channels=3, image_size=32)
    single.load_state_dict(rank0)  # rank 0's file is a complete single-device model

"""The mesh's cp dimension (labkit.parallel.cp) through labkit.strategies.mesh: a GPT whose sequences are split over
the ranks trains step for step like one process on the whole batch.

One spawn of 2 gloo ranks (``--mesh cp=2``, zig-zag and contiguous layouts): a 2-block GPT (d=32, T=16,
vocabulary 64, dropout 0) for 3 SGD-with-momentum steps, driven by the MeshStrategy's per-step hooks in the order
``labkit.train.train_step`` calls them (the loop's metrics still assume classification), then evaluation's whole
logits; the refusals of a model and a length cp cannot take. The oracle: the same steps in one process.

Tolerances (float32): the loss of every step within 1e-6 (the sum over the ranks' tokens is regrouped), the
weights after the last step within 1e-5.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from labkit.dist import DistEnv
from labkit.errors import ConfigError
from labkit.gpt import GPT, GPTConfig
from labkit.strategies.base import Strategy
from labkit.testing import run_ranks

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
BATCH, STEPS = 4, 3


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # (B, T, V), (B, T): mean over B*T tokens


def _tokens():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g),
             torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)) for _ in range(STEPS)]


def _steps(strategy, model):
    """train_step's order: zero_grad, forward_backward, sync_gradients, optimizer.step; this rank's losses, on
    its data shard of each global batch."""
    shards, index = strategy.data_shard() if hasattr(strategy, "data_shard") else (1, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _tokens():
        x, y = x.chunk(shards)[index], y.chunk(shards)[index]
        opt.zero_grad(set_to_none=True)
        loss, _ = strategy.forward_backward(model, x, y, lm_loss)
        strategy.sync_gradients(model)
        opt.step()
        losses.append(loss)
    return losses


def _run(env, mesh, options=None):
    """One mesh against the one-process oracle: losses, weights, evaluation logits (all pairs got, want)."""
    from labkit.strategies.mesh import MeshStrategy

    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    strategy = MeshStrategy(env, {"mesh": mesh, **(options or {})})
    strategy.check_model("gpt-tiny")
    model = strategy.prepare(model)
    losses = _steps(strategy, model)
    ref_losses = _steps(Strategy(DistEnv()), reference)
    x = _tokens()[0][0]
    with torch.no_grad():
        logits = strategy.forward(model.eval(), x), reference.eval()(x)
    ref_state = reference.state_dict()
    return {"losses": losses, "ref_losses": ref_losses, "logits": logits,
            "weights": {k: (v, ref_state[k]) for k, v in model.state_dict().items()}}


def _two_ranks(env):
    from labkit.strategies.mesh import MeshStrategy

    out = {layout: _run(env, "cp=2", {"cp_layout": layout}) for layout in ("zigzag", "contiguous")}
    refused = []
    strategy = MeshStrategy(env, {"mesh": "cp=2"})
    for attempt in (lambda: strategy.check_model("lenet"), lambda: strategy.prepare(GPT(CFG.replace(block_size=18))),
                    lambda: strategy.prepare(GPT(CFG.replace(dropout=0.1)))):
        try:
            attempt()
        except ConfigError as e:
            refused.append(str(e))
    out["refused"] = refused
    return out


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_ranks, 2, timeout=300)


def _check_equal(per_rank, ranks):
    # every rank's loss is the mean over its tokens (the same count on each): their mean is the batch's loss
    for step in range(STEPS):
        got = torch.stack([per_rank[r]["losses"][step] for r in ranks]).mean()
        torch.testing.assert_close(got, per_rank[0]["ref_losses"][step], rtol=0, atol=1e-6)
    for r in ranks:
        for name, (got, ref) in per_rank[r]["weights"].items():
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(*per_rank[r]["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_gpt_on_cp2_equals_one_process(two, layout):
    _check_equal([rank[layout] for rank in two], range(2))
    assert len(two[0][layout]["weights"]) == 37  # the GPT's own names (2 + 2 x 16 + 3): none added, none lost


def test_cp_refuses_what_it_cannot_split(two):
    lenet, length, dropout = two[0]["refused"]
    assert "--mesh cp=2 splits the sequences of a transformer; it needs --model gpt-tiny" in lenet
    assert "a length of 18 does not split; use a multiple of 4, e.g. 16 or 20" in length
    assert "ring attention has no attention dropout" in dropout

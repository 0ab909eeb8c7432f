"""The mesh's pp dimension (labkit.parallel.pp) through labkit.strategies.mesh: a GPT and a CNN cut into stages,
every step equal to the single-process step on the same (global) batch.

One spawn of 2 gloo ranks (``--mesh pp=2``): per schedule (GPipe, 1F1B) a 2-block GPT (d=32, T=16, vocabulary
64, dropout 0) for 3 SGD-with-momentum steps, driven by the MeshStrategy's per-step hooks in the order
``labkit.train.train_step`` calls them (the loop's metrics still assume classification), and a LeNet (its
nn.Sequential form) through ``labkit.train.fit`` itself, evaluation included. It also counts the bytes each
stage sends per step (literal numbers: the formula's prediction). One spawn of 4 ranks: the LeNet on
``--mesh dp=2,pp=2`` through ``fit`` against one process on the global batch (the mean of the two last stages'
losses every step).

Tolerances (float32): the loss of every step within 1e-6 (only the order of the micro-batch sums changes), the
weights after the last step within 1e-5; the tied embedding's two copies equal bit for bit.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.dist import DistEnv
from labkit.errors import ConfigError
from labkit.gpt import GPT, GPTConfig
from labkit.models import get_model
from labkit.parallel.pp import PipelineParallel, p2p_bytes_sent
from labkit.strategies.base import Strategy
from labkit.testing import run_ranks

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
BATCH, STEPS = 8, 3


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # (B, T, V), (B, T): mean over B*T tokens


def _tokens():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g),
             torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)) for _ in range(STEPS)]


def _images(n=24):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def _lenet():
    torch.manual_seed(2)
    return get_model("lenet", image_size=16, sequential=True)


def _steps(strategy, model, criterion):
    """train_step's order: zero_grad, forward_backward, sync_gradients, optimizer.step; the losses and the bytes
    the schedules sent, per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, sent = [], []
    for x, y in _tokens():
        opt.zero_grad(set_to_none=True)
        with p2p_bytes_sent() as count:
            loss, _ = strategy.forward_backward(model, x, y, criterion)
            strategy.sync_gradients(model)
        opt.step()
        losses.append(loss)
        sent.append(count["bytes"])
    return losses, sent


def _fit(strategy, model, dp=1):
    """labkit.train.fit as `labkit train` runs it: 1 epoch of 24 images in global batches of 8 (each of ``dp``
    data-parallel ranks 8 / dp of them), evaluation; the losses every step and the epoch's record. One process
    stands for ``dp`` ranks with a one-replica DistributedSampler: the same permutation, so its global batch s
    is the ranks' batches s."""
    from labkit.train import fit

    losses, inner = [], strategy.forward_backward

    def recorded(*args):
        loss, out = inner(*args)
        losses.append(loss)
        return loss, out
    strategy.forward_backward = recorded
    train = _images()
    sampler = strategy.sampler(train, True, 0) or (DistributedSampler(train, 1, 0, seed=0) if dp > 1 else None)
    loader = DataLoader(train, batch_size=BATCH // strategy.data_parallel_size, sampler=sampler)
    history = fit(model, loader, DataLoader(_images(10), batch_size=5), torch.optim.SGD(model.parameters(), lr=0.1,
                  momentum=0.9), epochs=1, strategy=strategy, printer=lambda line: None)
    return losses, history[0]


def _two_ranks(env):
    from labkit.strategies.mesh import MeshStrategy

    out = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        full = GPT(CFG)
        reference = copy.deepcopy(full)
        strategy = MeshStrategy(env, {"mesh": "pp=2", "schedule": schedule, "num_microbatches": 2})
        stage = strategy.prepare(full)
        losses, sent = _steps(strategy, stage, lm_loss)
        ref_losses, _ = _steps(Strategy(DistEnv()), reference, lm_loss)
        ref_state = reference.state_dict()
        out[schedule] = {"losses": losses, "ref_losses": ref_losses, "sent": sent, "owner": strategy.metric_owner(),
                         "balance": strategy.pipeline.balance, "tied": stage.tied_weight().detach(),
                         "weights": {k: (v, ref_state[k]) for k, v in stage.state_dict().items()}}
    strategy = MeshStrategy(env, {"mesh": "pp=2", "schedule": "1f1b", "num_microbatches": 2})
    stage = strategy.prepare(_lenet())
    losses, record = _fit(strategy, stage)
    reference = _lenet()
    ref_losses, ref_record = _fit(Strategy(DistEnv()), reference)
    start = sum(strategy.pipeline.balance[:env.rank])
    mine = reference[start:start + strategy.pipeline.balance[env.rank]]
    out["cnn"] = {"losses": losses, "ref_losses": ref_losses, "record": record, "ref_record": ref_record,
                  "weights": list(zip(stage.parameters(), mine.parameters(), strict=True))}
    out["errors"] = []
    for options in ({"schedule": "1f1b", "num_microbatches": 1}, {"balance": [1]}, {"balance": [2, 1]}):
        try:
            MeshStrategy(env, {"mesh": "pp=2", **options}).check_model("gpt-tiny")
        except ConfigError as exc:
            out["errors"].append(str(exc))
    return out


def _four_ranks(env):
    from labkit.strategies.mesh import MeshStrategy

    strategy = MeshStrategy(env, {"mesh": "dp=2,pp=2", "schedule": "gpipe", "num_microbatches": 2})
    stage = strategy.prepare(_lenet())
    losses, record = _fit(strategy, stage)
    reference = _lenet()
    ref_losses, ref_record = _fit(Strategy(DistEnv()), reference, dp=2)
    pp = strategy.pipeline
    start = sum(pp.balance[:pp.rank])
    mine = reference[start:start + pp.balance[pp.rank]]
    return {"cnn": {"losses": losses, "ref_losses": ref_losses, "record": record, "ref_record": ref_record,
                    "data": strategy.data_shard(), "stage": pp.rank,
                    "weights": list(zip(stage.parameters(), mine.parameters(), strict=True))}}


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=300)


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_ranks, 2, timeout=300)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_on_pp2_equals_one_process(two, schedule):
    first, last = two[0][schedule], two[1][schedule]
    assert first["balance"] == [1, 1] and not first["owner"] and last["owner"]
    assert first["losses"] == [None] * STEPS  # only the last stage has the loss
    for got, ref in zip(last["losses"], last["ref_losses"], strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    names = {0: set(first["weights"]), 1: set(last["weights"])}
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.attn.q.weight"} <= names[0]
    assert {"blocks.1.mlp.fc.weight", "ln_f.weight", "head.weight"} <= names[1] and not names[0] & names[1]
    for rank in (first, last):
        for name, (got, ref) in rank["weights"].items():
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=name)
    # the tied matrix's two copies: equal bit for bit (each got the summed gradient), and equal to the one model's
    assert torch.equal(first["tied"], last["tied"])
    torch.testing.assert_close(last["tied"], last["weights"]["head.weight"][1], rtol=0, atol=1e-5)


def test_cnn_on_pp2_through_fit_equals_one_process(two):
    first, last = two[0]["cnn"], two[1]["cnn"]
    assert first["losses"] == [None] * 3 and len(last["losses"]) == 3
    for got, ref in zip(last["losses"], last["ref_losses"], strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    for rank in (first, last):
        for got, ref in rank["weights"]:
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        for key in ("train_loss", "train_acc", "test_loss", "test_acc"):  # summed over the ranks: the last's
            assert rank["record"][key] == pytest.approx(rank["ref_record"][key], abs=1e-5)


def test_bytes_per_step_are_the_formulas():
    # B=8, T=16, C=32, float32, V=64: 2 directions x (8 x 16 x 32 x 4 bytes) + the (64, 32) copy from each of 2
    price = PipelineParallel.price(batch=8, seq_len=16, n_embd=32, vocab_size=64, num_stages=2)
    assert price == {"activations": 32768, "embedding": 16384, "total": 49152}
    assert PipelineParallel.price(8, 16, 32, 64, num_stages=4, tp=2, sequence_parallel=True)["activations"] == 49152


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_sends_what_the_formula_says(two, schedule):
    # after the first step (whose one-time shape exchange is no p2p batch): 16,384 bytes each way per step,
    # stage 0 the 2 micro-batches' (4, 16, 32) activations forward, stage 1 their gradients back
    assert two[0][schedule]["sent"][1:] == [16384] * (STEPS - 1)
    assert two[1][schedule]["sent"][1:] == [16384] * (STEPS - 1)
    assert two[0][schedule]["tied"].numel() * 4 == 8192  # the embedding all-reduce: 8,192 bytes from each rank


def test_cnn_on_dp2_pp2_through_fit_equals_one_process_on_the_global_batch(four):
    cnn = [r["cnn"] for r in four]
    # mesh order (pp, dp, ...): ranks 0, 1 hold stage 0 of replicas 0, 1; ranks 2, 3 stage 1
    assert [(c["stage"], c["data"]) for c in cnn] == [(0, (2, 0)), (0, (2, 1)), (1, (2, 0)), (1, (2, 1))]
    assert cnn[0]["losses"] == cnn[1]["losses"] == [None] * 3
    global_losses = torch.stack([torch.stack(c["losses"]) for c in cnn[2:]]).mean(0)  # mean of the shards' means
    torch.testing.assert_close(global_losses, torch.stack(cnn[0]["ref_losses"]), rtol=0, atol=1e-6)
    for c in cnn:
        for got, ref in c["weights"]:
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
            assert c["record"][key] == pytest.approx(c["ref_record"][key], abs=1e-5)


def test_bad_pp_options_are_one_clear_line_before_any_work(two):
    assert two[0]["errors"] == two[1]["errors"] == [
        "--schedule 1f1b needs --num-microbatches >= the number of stages (pp=2), got 1",
        "--balance 1 gives 1 stage(s) but pp=2; give one count per stage",
        "--balance 2 1 sums to 3 but the model has 2 layers; give layer counts that add up to 2"]

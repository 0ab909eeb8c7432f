"""The mesh's pp dimension (labkit.parallel.pp): a GPT and a CNN cut into stages, each step equal to the
single-process step on the same batch.

One spawn of 2 gloo ranks (``--mesh pp=2``) trains, per schedule (GPipe, 1F1B), a 2-block GPT (d=32, T=16,
vocabulary 64, dropout 0) for 3 SGD-with-momentum steps and a LeNet (its nn.Sequential form) for 2, beside the
same model in one process: the loss every step, every weight after the last step, and the tied embedding's
two copies. It also counts the bytes each stage sends per step (literal numbers: the formula's prediction).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.gpt import GPT, GPTConfig
from labkit.models import get_model
from labkit.parallel.pp import PipelineParallel, p2p_bytes_sent
from labkit.testing import run_ranks

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
BATCH, STEPS = 8, 3


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # (B, T, V), (B, T): mean over B*T tokens


def _batches(n, image=False):
    g = torch.Generator().manual_seed(7)
    if image:
        return [(torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
                for _ in range(n)]
    return [(torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g),
             torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)) for _ in range(n)]


def _train(model, batches, criterion, dim=None):
    """The loop fit() runs per step: forward/backward, gradient sync, optimizer step; the losses it sees."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, sent = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        with p2p_bytes_sent() as count:
            if dim is None:
                loss = criterion(model(x), y)
                loss.backward()
            else:
                loss, _ = dim.forward_backward(model, x, y, criterion)
                dim.sync_gradients(model)
        opt.step()
        losses.append(None if loss is None else loss.detach())
        sent.append(count["bytes"])
    return losses, sent


def _on_rank(env):
    from labkit.mesh import build_mesh

    mesh = build_mesh({"pp": 2})
    out = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        full = GPT(CFG)
        reference = copy.deepcopy(full)
        dim = PipelineParallel(mesh, {"schedule": schedule, "num_microbatches": 2})
        stage = dim.parallelize(full)
        losses, sent = _train(stage, _batches(STEPS), lm_loss, dim)
        ref_losses, _ = _train(reference, _batches(STEPS), lm_loss)
        ref_state = reference.state_dict()
        out[schedule] = {"losses": losses, "ref_losses": ref_losses, "sent": sent, "balance": dim.balance,
                         "owns": dim.owns_metrics(), "tied": stage.tied_weight().detach(),
                         "weights": {k: (v, ref_state[k]) for k, v in stage.state_dict().items()}}
    torch.manual_seed(0)
    full = get_model("lenet", sequential=True)
    reference = copy.deepcopy(full)
    dim = PipelineParallel(mesh, {"schedule": "gpipe", "num_microbatches": 2})
    stage = dim.parallelize(full)
    losses, sent = _train(stage, _batches(2, image=True), nn.CrossEntropyLoss(), dim)
    ref_losses, _ = _train(reference, _batches(2, image=True), nn.CrossEntropyLoss())
    start = sum(dim.balance[:env.rank])
    mine = reference[start:start + dim.balance[env.rank]]
    out["cnn"] = {"losses": losses, "ref_losses": ref_losses, "balance": dim.balance,
                  "weights": list(zip(stage.parameters(), mine.parameters()))}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_on_rank, 2, timeout=300)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_on_two_stages_equals_single_process_training(ranks, schedule):
    first, last = ranks[0][schedule], ranks[1][schedule]
    assert first["balance"] == [1, 1] and not first["owns"] and last["owns"]
    assert first["losses"] == [None] * STEPS  # only the last stage has the loss
    for got, ref in zip(last["losses"], last["ref_losses"]):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)  # float32, micro-batch means reordered
    names = {0: set(first["weights"]), 1: set(last["weights"])}
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.attn.q.weight"} <= names[0]
    assert {"blocks.1.mlp.fc.weight", "ln_f.weight", "head.weight"} <= names[1] and not names[0] & names[1]
    for rank in (first, last):
        for name, (got, ref) in rank["weights"].items():
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4, msg=name)  # 3 momentum steps
    # the tied matrix's two copies: equal bit for bit (each got the summed gradient), and equal the single model's
    assert torch.equal(first["tied"], last["tied"])
    torch.testing.assert_close(last["tied"], last["weights"]["head.weight"][1], atol=1e-5, rtol=1e-4)


def test_cnn_sequential_on_two_stages_equals_single_process_training(ranks):
    first, last = ranks[0]["cnn"], ranks[1]["cnn"]
    assert first["balance"] == last["balance"] and len(first["balance"]) == 2
    assert first["losses"] == [None, None]
    for got, ref in zip(last["losses"], last["ref_losses"]):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    for rank in (first, last):
        for got, ref in rank["weights"]:
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_bytes_per_step_are_the_formulas():
    # B=8, T=16, C=32, float32: stage 0 sends 2 micro-batches of (4, 16, 32) forward, stage 1 their gradients back
    price = PipelineParallel.price(batch=8, seq_len=16, n_embd=32, vocab_size=64, num_stages=2)
    assert price == {"activations": 32768, "embedding": 16384, "total": 49152}
    assert PipelineParallel.price(8, 16, 32, 64, num_stages=4, tp=2, sequence_parallel=True)["activations"] == 49152


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_sends_what_the_formula_says(ranks, schedule):
    # after the first step (its one-time shape exchange is not a p2p batch): 16,384 bytes each way
    assert ranks[0][schedule]["sent"][1:] == [16384] * (STEPS - 1)
    assert ranks[1][schedule]["sent"][1:] == [16384] * (STEPS - 1)
    # the embedding all-reduce moves the (64, 32) float32 copy: 8,192 bytes from each of the 2 ranks
    assert ranks[0][schedule]["tied"].numel() * 4 == 8192

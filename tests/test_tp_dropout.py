"""Dropout under Megatron tensor parallelism (labkit.parallel.tp_rng), on two gloo CPU ranks of one tp group.

One 2-rank spawn, a 2-layer GPT (d=32, T=16, 4 heads, vocabulary 64) at dropout 0.5 in training mode:

* one step of the sharded model by hand, without and with sequence parallelism: the embedding and residual
  dropout masks (five a forward: the embedding's, two per block) are identical on both ranks without SP (they act
  on the replicated (B, T, C)) and differ with SP (each rank's own tokens); the attention dropout differs between
  the ranks (their heads are made twins, q/k/v of rank 1's heads a copy of rank 0's, so without dropout, or with
  one shared stream, both ranks' attention outputs would be equal: the eval-mode forward shows they are); after
  the step the default random stream is in the same state on both ranks (the tracker gives it back);
* ``labkit.train.loop.fit`` on ``--mesh tp=2`` (twice, same seed) and ``tp=2 --sequence-parallel``: the loss is
  finite and falls, the two tp=2 runs are bit-identical (losses and weights), and the 15 replicated parameters
  (layer norms, row-parallel biases, position table) stay bit-identical on the two ranks: replicated masks that
  differed would make the replicas drift apart.

At dropout 0 nothing changes (the tracker is not installed): tests/test_megatron.py, test_mesh.py and test_gpt.py
keep their equalities.
"""
import torch
from torch.utils.data import DataLoader, TensorDataset

from labkit.cli import main
from labkit.dist.testing import run_ranks
from labkit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.5)
B, T, STEPS, SEED = 2, 16, 8, 3
HALF = CFG.n_embd // 2  # rank r's q/k/v rows: [r·16, (r+1)·16), its 2 of the 4 heads
REPLICATED = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.proj.bias", "mlp.proj.bias",
              "ln_f.weight", "ln_f.bias", "pos_emb.weight")


def _twin_heads(model: GPT) -> GPT:
    with torch.no_grad():
        for block in model.blocks:
            for layer in (block.attn.q, block.attn.k, block.attn.v):
                layer.weight[HALF:] = layer.weight[:HALF]
                layer.bias[HALF:] = layer.bias[:HALF]
    return model


def _one_step(sp: bool) -> dict:
    """One forward/backward of the sharded GPT in training mode (and one forward in eval mode), recording the
    dropout masks and each block's attention output on this rank's heads."""
    from labkit.parallel.megatron import VocabParallelCrossEntropy, parallelize_gpt

    torch.manual_seed(0)
    model = parallelize_gpt(_twin_heads(GPT(CFG)), None, sequence_parallel=sp)
    seen = {"masks": [], "attn": []}
    for drop in [model.drop] + [block.drop for block in model.blocks]:
        drop.register_forward_hook(lambda m, args, out: seen["masks"].append(out == 0))
    for block in model.blocks:
        block.attn.proj.register_forward_pre_hook(lambda m, args: seen["attn"].append(args[0].detach().clone()))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, CFG.vocab_size, (B, T), generator=g) for _ in range(2))
    with torch.no_grad():
        model.eval()(x)
    eval_attn, seen["attn"], seen["masks"] = seen["attn"], [], []
    torch.manual_seed(11)  # the default stream: the same on both ranks, as fit seeds a tp group
    VocabParallelCrossEntropy(None, CFG.vocab_size)(model.train()(x), y).backward()
    return dict(seen, eval_attn=eval_attn, rng=torch.get_rng_state())


def _data():
    """Sequences counting up modulo 8 from a random start: the next token is learnable in a few steps."""
    start = torch.randint(0, 8, (STEPS * 4 + 4, 1), generator=torch.Generator().manual_seed(0))
    tokens = (start + torch.arange(T + 1)) % 8
    return TensorDataset(tokens[:-4, :-1], tokens[:-4, 1:]), TensorDataset(tokens[-4:, :-1], tokens[-4:, 1:])


def _fit(env, options: dict) -> dict:
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.loop import fit
    from labkit.train.tasks import LanguageModelling

    strategy = MeshStrategy(env, options)
    strategy.check_model("gpt-tiny")
    torch.manual_seed(1)
    model = strategy.prepare(GPT(CFG))
    losses, inner = [], strategy.forward_backward

    def forward_backward(*args):
        loss, out = inner(*args)
        losses.append(loss.detach().clone())
        return loss, out

    strategy.forward_backward = forward_backward
    train, test = _data()
    task = LanguageModelling()
    fit(model, DataLoader(train, batch_size=4, sampler=strategy.sampler(train, True, SEED), drop_last=True),
        DataLoader(test, batch_size=4), torch.optim.Adam(model.parameters(), lr=1e-2), epochs=1,
        strategy=strategy, seed=SEED, criterion=task.criterion(), task=task, printer=lambda line: None)
    return {"losses": torch.stack(losses), "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _ranks(env) -> dict:
    return {"tp": _one_step(False), "sp": _one_step(True), "fit": _fit(env, {"mesh": "tp=2"}),
            "again": _fit(env, {"mesh": "tp=2"}), "fit sp": _fit(env, {"mesh": "tp=2", "sequence_parallel": True})}


def test_tp_dropout_masks_streams_and_fit_on_two_ranks():
    r0, r1 = run_ranks(_ranks, 2, timeout=240)
    for key, shard in (("tp", T), ("sp", T // 2)):
        a, b = r0[key], r1[key]
        assert len(a["masks"]) == len(b["masks"]) == 5  # embedding + 2 blocks x (attention, MLP) residuals
        assert all(m.shape == (B, shard, CFG.n_embd) for m in a["masks"] + b["masks"])
        assert all(0.35 < m.float().mean() < 0.65 for m in a["masks"] + b["masks"])  # p = 0.5
        same = [torch.equal(m, n) for m, n in zip(a["masks"], b["masks"])]
        assert same == ([True] * 5 if key == "tp" else [False] * 5), (key, same)
        assert len(a["attn"]) == len(a["eval_attn"]) == 2
        for i in range(2):  # twin heads: equal without dropout, different masks in training
            assert torch.allclose(a["eval_attn"][i], b["eval_attn"][i], atol=1e-6)
            assert not torch.allclose(a["attn"][i], b["attn"][i], atol=1e-3), (key, i)
        assert torch.equal(a["rng"], b["rng"])  # the default stream given back, the same on both ranks
    for key in ("fit", "again", "fit sp"):
        losses = r0[key]["losses"]
        assert len(losses) == STEPS and torch.isfinite(losses).all() and torch.equal(losses, r1[key]["losses"])
        assert losses[-2:].mean() < losses[:2].mean() - 0.5, (key, losses)
        replicated = [n for n in r0[key]["weights"] if n.endswith(REPLICATED)]
        assert len(replicated) == 15
        assert all(torch.equal(r0[key]["weights"][n], r1[key]["weights"][n]) for n in replicated), key
    for r in (r0, r1):  # the same seed: the same run, bit for bit
        assert torch.equal(r["fit"]["losses"], r["again"]["losses"])
        assert all(torch.equal(w, r["again"]["weights"][n]) for n, w in r["fit"]["weights"].items())


def test_dropout_for_a_model_without_it_is_one_line(tmp_path, capsys):
    assert main(["train", "--model", "lenet", "--dropout", "0.1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit: error: --dropout applies to the GPT models"), err

"""Context parallelism over real ranks, in one spawn of 4 gloo ranks: ring attention against single-device
``scaled_dot_product_attention`` at cp = 2, 3, 4 (subgroups), the work and bytes each rank counted, activation
memory per rank against the formula, and the mesh's cp dimension (labkit.parallel.cp) through
labkit.parallel.mesh: a GPT on ``--mesh dp=2,cp=2`` (zig-zag and contiguous) and on ``cp=2,tp=2`` through
``labkit.train.loop.fit`` steps like one process through ``fit`` on the whole batch; the refusals of a model, a length
and a dropout cp cannot take.

The GPT: 2 blocks, d=32, T=16, vocabulary 64, dropout 0; the LM task, momentum SGD, one epoch of 3 steps of a
global batch of 4 sequences, then evaluation (the logits gathered over cp and tp). The oracle: ``fit`` in one
process on the same global batches. Compared: the loss of every step (the mean of the ranks' losses), the
epoch's train/test loss and perplexity as the loop sums them, every weight after the last step.

Tolerances: ring attention in float64 within 1e-9 relative / 1e-10 absolute of SDPA (rounding only); the GPT in
float32, the loss of every step within 1e-6 (the sum over the ranks' tokens is regrouped), the weights after the
last step within 1e-5, the epoch's records within 1e-6 relative.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from labkit.collectives.kv_ring import kv_ring
from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.models.gpt import GPT, GPTConfig
from labkit.parallel.memory import predict_memory
from labkit.parallel.ring_attention import shard, unshard
from labkit.strategies.base import Strategy

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
GLOBAL_BATCH, STEPS, SEED = 4, 3, 5


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # (B, T, V), (B, T): mean over B*T tokens


def _data():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS * GLOBAL_BATCH + 4, CFG.block_size + 1), generator=g)
    pairs = TensorDataset(tokens[:, :-1], tokens[:, 1:])  # next-token targets
    return Subset(pairs, range(STEPS * GLOBAL_BATCH)), Subset(pairs, range(STEPS * GLOBAL_BATCH, len(pairs)))


def _logged_all_reduces(sync, calls: list):
    """``sync`` (a strategy's sync_gradients) with every ``dist.all_reduce`` it makes logged in ``calls`` as
    (elements, ranks in the group)."""
    def logged_sync(model):
        original = torch.distributed.all_reduce

        def logged(tensor, *args, group=None, **kwargs):
            calls.append((tensor.numel(), torch.distributed.get_world_size(group)))
            return original(tensor, *args, group=group, **kwargs)
        torch.distributed.all_reduce = logged
        try:
            sync(model)
        finally:
            torch.distributed.all_reduce = original
    return logged_sync


def _fit(strategy, model):
    """labkit.train.loop.fit as ``labkit train`` runs it (the LM task, momentum SGD, 1 epoch of 3 steps, evaluation);
    this rank's loss of every step and the epoch's record."""
    from labkit.train.loop import fit
    from labkit.train.tasks import get_task

    losses, inner = [], strategy.forward_backward

    def recorded(*args):
        loss, out = inner(*args)
        losses.append(loss)
        return loss, out
    strategy.forward_backward = recorded
    calls: list = []
    strategy.sync_gradients = _logged_all_reduces(strategy.sync_gradients, calls)
    train, test = _data()
    sampler = strategy.sampler(train, True, SEED) or DistributedSampler(train, num_replicas=1, rank=0, seed=SEED)
    batch = GLOBAL_BATCH // strategy.data_parallel_size
    history = fit(model, DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True),
                  DataLoader(test, batch_size=2, sampler=strategy.sampler(test, False, SEED)),
                  torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), epochs=1, strategy=strategy, seed=SEED,
                  task=get_task("lm"), printer=lambda line: None)
    return losses, {**history[0], "sync_calls": calls}


@functools.cache
def _oracle():
    """One process through fit on the whole batch: losses, record, weights (the same for every mesh: run once)."""
    torch.manual_seed(0)
    reference = GPT(CFG)
    losses, record = _fit(Strategy(DistEnv()), reference)
    return losses, record, reference.state_dict()


def _run(env, mesh, options=None):
    """One mesh through fit against one process through fit: losses, records, weights (pairs got, want)."""
    from labkit.parallel.mesh import MeshStrategy

    ref_losses, ref_record, ref_state = _oracle()
    torch.manual_seed(0)
    model = GPT(CFG)
    strategy = MeshStrategy(env, {"mesh": mesh, **(options or {})})
    strategy.check_model("gpt-tiny")
    model = strategy.prepare(model)
    losses, record = _fit(strategy, model)
    tp = getattr(model, "tp_group", None)
    weights = {k: (_whole(v, ref_state[k], tp), ref_state[k]) for k, v in model.state_dict().items()}
    sharded = sum(v.shape != ref_state[k].shape for k, v in model.state_dict().items())
    return {"losses": losses, "ref_losses": ref_losses, "record": record, "ref_record": ref_record,
            "weights": weights, "sharded": sharded}


def _whole(local, ref, group):
    """A tensor-parallel shard gathered back to the full tensor's shape (the dimension it was cut along)."""
    if group is None or local.shape == ref.shape:
        return local
    from labkit.dist.group import all_gather

    dim = next(d for d, (a, b) in enumerate(zip(local.shape, ref.shape)) if a != b)
    parts = all_gather([torch.empty_like(local) for _ in range(2)], local.contiguous(), group=group)
    return torch.cat(parts, dim)


def _ring_vs_sdpa(env, groups, seq_len):
    """On every subgroup of 2, 3 and 4 ranks: ring attention, causal and not, zig-zag and contiguous; per case
    this rank's output and gradient shards, and what it counted."""
    from labkit.parallel.ring_attention import RingStats, ring_attention

    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(2, 2, seq_len, 4, generator=g, dtype=torch.float64) for _ in range(4))
    results = {}
    for n, group in groups.items():
        if env.rank >= n:
            continue
        for causal in (True, False):
            for layout in ("zigzag", "contiguous"):
                ring = kv_ring(n, causal, layout)
                mine = [shard(t, ring, env.rank, 2).requires_grad_() for t in (q, k, v)]
                stats = RingStats()
                out = ring_attention(*mine, ring, group, stats=stats)
                (out * shard(w, ring, env.rank, 2)).sum().backward()
                results[n, causal, layout] = (out.detach(), *(t.grad for t in mine), stats)
    return results


def _memory(env, groups):
    """Saved-tensor bytes of one forward of the GPT (batch 2) on this rank, at T = 16, 32 and cp = 1, 2, 4."""
    from labkit.parallel.cp import RingSelfAttention
    from labkit.parallel.cp_memory import saved_tensor_bytes
    from labkit.parallel.ring_attention import positions

    out = {}
    for seq_len in (16, 32):
        g = torch.Generator().manual_seed(2)
        x, y = (torch.randint(0, CFG.vocab_size, (2, seq_len), generator=g) for _ in range(2))
        for cp in (1, 2, 4):
            model = GPT(CFG.replace(block_size=seq_len))
            xs, ys, pos = x, y, None
            if cp > 1:
                if env.rank >= cp:
                    continue
                ring = kv_ring(cp)
                for block in model.blocks:
                    block.attn = RingSelfAttention(block.attn, ring, groups[cp])
                xs, ys = shard(x, ring, env.rank, 1), shard(y, ring, env.rank, 1)
                pos = positions(ring, env.rank, seq_len // (2 * cp))
            out[seq_len, cp] = saved_tensor_bytes(lambda: lm_loss(model(xs, pos), ys), model.parameters())
    return out


def _four_ranks(env):
    import torch.distributed as dist

    from labkit.parallel.mesh import MeshStrategy

    groups = {n: dist.new_group(list(range(n))) for n in (2, 3, 4)}  # every rank creates every group
    out = {"sdpa": _ring_vs_sdpa(env, groups, 24), "memory": _memory(env, groups)}
    out.update({layout: _run(env, "dp=2,cp=2", {"cp_layout": layout}) for layout in ("zigzag", "contiguous")})
    out["tp"] = _run(env, "cp=2,tp=2")
    refused = []
    strategy = MeshStrategy(env, {"mesh": "dp=2,cp=2"})
    for attempt in (lambda: strategy.check_model("lenet"), lambda: strategy.prepare(GPT(CFG.replace(block_size=18))),
                    lambda: strategy.prepare(GPT(CFG.replace(dropout=0.1))),
                    lambda: strategy.check_model("gpt-tiny", 30),
                    lambda: strategy.check_model("gpt-tiny", 16, 0.1),
                    lambda: MeshStrategy(env, {"mesh": "pp=2,cp=2"}).check_model("gpt-tiny")):
        try:
            attempt()
        except ConfigError as e:
            refused.append(str(e))
    out["refused"] = refused
    out["ring_refused"] = _ring_refusals(env, groups[2]) if env.rank < 2 else []
    return out


def _ring_refusals(env, group):
    """ring_attention called directly on 2 ranks with lengths that cannot work: each raises on both ranks."""
    from labkit.parallel.ring_attention import ring_attention

    messages = []
    for lengths, layout in (((12, 10), "zigzag"), ((5, 5), "zigzag"), ((6, 6), "contiguous")):
        t = torch.zeros(1, 2, lengths[env.rank], 4)
        try:
            ring_attention(t, t, t, kv_ring(2, True, layout), group)
            messages.append("ran")
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=300)


def test_ring_attention_equals_sdpa_at_cp_2_3_4(four):
    seq_len = 24  # splits into 2 * cp chunks for cp = 2, 3, 4
    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(2, 2, seq_len, 4, generator=g, dtype=torch.float64) for _ in range(4))
    for causal in (True, False):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        want = F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
        (want * w).sum().backward()
        for n in (2, 3, 4):
            for layout in ("zigzag", "contiguous"):
                ring = kv_ring(n, causal, layout)
                got = [unshard([four[r]["sdpa"][n, causal, layout][i] for r in range(n)], ring, 2) for i in range(4)]
                for mine, ref in zip(got, (want, q_.grad, k_.grad, v_.grad)):
                    torch.testing.assert_close(mine, ref, rtol=1e-9, atol=1e-10)


def test_work_and_bytes_counted_on_the_ranks(four):
    def counted(n, causal, layout, field):
        return [getattr(four[r]["sdpa"][n, causal, layout][4], field) for r in range(n)]
    # causal work per rank (score entries per batch row and head, T = 24, cp = 4): the zig-zag split evens it
    assert counted(4, True, "contiguous", "score_entries") == [36, 72, 108, 144]
    assert counted(4, True, "zigzag", "score_entries") == [90, 90, 90, 90]
    # bytes each rank sent: (6p - 4) tensors of B*H*(T/p)*D float64 = 20 * 2*2*6*4 * 8 bytes at cp = 4
    assert counted(4, True, "zigzag", "bytes_sent") == [15360] * 4
    assert counted(3, False, "zigzag", "bytes_sent") == [14 * 2 * 2 * 8 * 4 * 8] * 3 == [14336] * 3


def test_activation_memory_per_rank_falls_as_one_over_cp(four):
    measured = four[0]["memory"]
    assert measured == {(16, 1): 149892, (16, 2): 74948, (16, 4): 37476,
                        (32, 1): 299780, (32, 2): 149892, (32, 4): 74948}
    assert {(T, cp): predict_memory(CFG.replace(block_size=T), 2, cp=cp)["activations"]
            for T, cp in measured} == measured
    assert four[3]["memory"] == {(16, 1): 149892, (16, 4): 37476, (32, 1): 299780, (32, 4): 74948}  # as rank 0


def _check_equal(per_rank):
    # every rank's loss is the mean over its tokens (the same count on each): their mean is the batch's loss
    for step in range(STEPS):
        got = torch.stack([rank["losses"][step] for rank in per_rank]).mean()
        torch.testing.assert_close(got, per_rank[0]["ref_losses"][step], rtol=0, atol=1e-6)
    for rank in per_rank:
        for name, (got, ref) in rank["weights"].items():
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=name)
        for key in ("train_loss", "train_ppl", "test_loss", "test_ppl"):  # the loop's own sums over the ranks
            assert rank["record"][key] == pytest.approx(rank["ref_record"][key], rel=1e-6)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_gpt_on_dp2_cp2_through_fit_equals_one_process(four, layout):
    _check_equal([rank[layout] for rank in four])
    assert len(four[0][layout]["weights"]) == 37  # the GPT's own names (2 + 2 x 16 + 3): none added, none lost
    # one all-reduce per step over the 4 ranks of dp x cp, flattened: all 28,032 parameters (one bucket; 2,048 +
    # 512 embeddings, 2 x 12,704 per block, 64 ln_f), not one over cp and then one over dp
    assert [rank[layout]["record"]["sync_calls"] for rank in four] == [[(28032, 4)] * STEPS] * 4


def test_gpt_on_cp2_tp2_through_fit_equals_one_process(four):
    _check_equal([rank["tp"] for rank in four])
    # tp's shards, gathered for the comparison: per block q, k, v (weight, bias), attn.proj.weight, mlp.fc
    # (weight, bias), mlp.proj.weight = 10, twice, and the tied tok_emb/head matrix under both its names
    assert [rank["tp"]["sharded"] for rank in four] == [22] * 4 and four[0]["zigzag"]["sharded"] == 0


def test_cp_refuses_what_it_cannot_split(four):
    lenet, length, dropout, seq_len, early_dropout, pp = four[0]["refused"]
    assert "--mesh cp=2 splits the sequences of a transformer; it needs --model gpt-tiny" in lenet
    assert "a length of 18 does not split; use a multiple of 4, e.g. 16 or 20" in length
    assert "ring attention has no attention dropout" in dropout
    assert seq_len.endswith("a length of 30 does not split; use a multiple of 4, e.g. 28 or 32")
    assert early_dropout == ("--mesh cp=2: ring attention has no attention dropout; train with dropout 0 "
                             "(--dropout 0.1)")
    assert pp.startswith("--mesh cp=2 with pp=2 is not supported")
    # ring_attention called directly: the same one line on both ranks, no transport error, no wrong output
    assert four[0]["ring_refused"] == four[1]["ring_refused"] and four[2]["ring_refused"] == []
    unequal, odd, fine = four[0]["ring_refused"]
    assert unequal == ("ring_attention: the ranks hold different shapes (B, H, T_local, D): rank 0 (1, 2, 12, 4), "
                       "rank 1 (1, 2, 10, 4); every rank of the ring holds the same number of tokens, T / 2")
    assert odd == ("ring_attention: a local length of 5 does not split into the 2 chunks each rank holds (zigzag); "
                   "give each rank a multiple of 2 tokens")
    assert fine == "ran"  # contiguous: one chunk per rank, any length

"""Mixture of experts (labkit.models.moe) and expert parallelism (labkit.parallel.ep).

Single process: the router's gates and capacity on hand-made probabilities, the balancing loss against a hand
computation, the loss injector's gradient, the layer against a per-token loop. Two spawns: ``ep=2`` (2 ranks) and
``dp=2,ep=2`` (4 ranks) against single-process training on the global batch: loss every step, gradients of step 0,
weights after STEPS steps, tokens per expert and dropped choices every step, and the test loss after them, all
through ``MeshStrategy`` and ``labkit.train.loop.fit``: ``ep=2`` for top-1 and for top-2 with a capacity factor that
drops, ``dp=2,ep=2`` for the latter with replicas and with ``--dp-shard fsdp``. Float64 (tolerance 1e-10), so that no near-tie in the router flips
between the two runs. The ep=2 spawn also counts the exchange's bytes with the routing forced even.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.models.gpt import gpt
from labkit.models.moe import AddAuxLoss, MoE, MoEConfig, balance_loss, gpt_moe, moe_layers, route
from labkit.models.recompute import set_recompute
from labkit.parallel.ep import ExpertParallel, dense_allreduce_bytes
from labkit.train.tasks import LanguageModelling

V, T, B, STEPS = 48, 16, 8, 3                           # global batch B sequences of T tokens
CASES = {"top1": dict(top_k=1, capacity_factor=None), "top2-cap": dict(top_k=2, capacity_factor=1.0)}
TOL = dict(rtol=0, atol=1e-10)


# ----- single process ---------------------------------------------------------------------------------------

def test_route_gates_and_capacity_by_hand():
    probs = torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]]])        # (1 group, T=4, E=2)
    r = route(probs, 1, None)
    assert r.experts.flatten().tolist() == [0, 0, 1, 0]
    assert torch.allclose(r.gates.flatten(), torch.tensor([0.7, 0.6, 0.8, 0.9]))      # top-1: not renormalised
    assert r.keep.all()
    r = route(probs, 1, 1.0)                    # capacity ceil(1.0 * 4 * 1 / 2) = 2: expert 0's third token drops
    assert r.keep.flatten().tolist() == [True, True, True, False]

    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.1, 0.2, 0.7]]])     # T=3, E=3
    r = route(probs, 2, None)
    assert r.experts[0].tolist() == [[0, 1], [0, 2], [2, 1]]
    assert torch.allclose(r.gates[0], torch.tensor([[5 / 8, 3 / 8], [2 / 3, 1 / 3], [7 / 9, 2 / 9]]))  # sum to 1
    # capacity ceil(0.5 * 3 * 2 / 3) = 1; first choices fill first: t0->0, t2->2 kept, t1->0 over; then the
    # second choices: t0->1 kept, t1->2 and t2->1 over (2 and 1 are full)
    r = route(probs, 2, 0.5)
    assert r.keep[0].tolist() == [[True, True], [False, False], [True, False]]


def test_balance_loss_by_hand():
    probs = torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]]], requires_grad=True)
    experts = torch.tensor([[[0], [0], [1], [0]]])
    aux = balance_loss(probs, experts, alpha=0.01)
    # f = (3/4, 1/4), P = (0.6, 0.4): 0.01 * 2 * (0.75 * 0.6 + 0.25 * 0.4) = 0.011
    assert aux.item() == pytest.approx(0.011, abs=1e-8)
    aux.backward()                              # d aux / d p_i(token) = α E f_i / T = (0.00375, 0.00125)
    assert torch.allclose(probs.grad, torch.tensor([0.00375, 0.00125]).expand(1, 4, 2))
    # two groups: the mean of the groups' losses (group 2 uniform: α E Σ (1/2)(1/2) = 0.01)
    both = torch.cat([probs.detach(), torch.full((1, 4, 2), 0.5)])
    assert balance_loss(both, torch.tensor([[[0], [0], [1], [0]], [[0], [1], [0], [1]]]), 0.01).item() == \
        pytest.approx((0.011 + 0.01) / 2, abs=1e-8)


def test_aux_loss_injector_gives_the_gradient_of_loss_plus_aux():
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    x = torch.tensor([[0.5, 1.5], [2.0, -1.0]], requires_grad=True)
    c = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    y = AddAuxLoss.apply(x, (w ** 2).sum())
    assert torch.equal(y, x)
    (y * c).sum().backward()
    assert x.grad.tolist() == [[1.0, 2.0], [3.0, 4.0]] and w.grad.tolist() == [2.0, -4.0, 6.0]


def _forced_moe(cfg_k: int = 1, capacity_factor=None, n_embd: int = 8) -> MoE:
    """A MoE whose router sends a token with x = 3·e_i (+ 2·e_j) to expert i (then j)."""
    from labkit.models.gpt import GPTConfig
    torch.manual_seed(0)
    moe = MoE(GPTConfig(n_embd=n_embd), MoEConfig(n_expert=4, top_k=cfg_k, capacity_factor=capacity_factor))
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4, n_embd))
    return moe.double()


def test_moe_layer_equals_a_per_token_loop_and_counts():
    moe = _forced_moe(2, capacity_factor=0.5)   # capacity ceil(0.5 * 6 * 2 / 4) = 2 per expert
    first, second = [0, 0, 0, 1, 2, 1], [1, 2, 3, 0, 3, 2]
    x = torch.zeros(1, 6, 8, dtype=torch.float64)
    for t, (i, j) in enumerate(zip(first, second)):
        x[0, t, i], x[0, t, j] = 3.0, 2.0
    y = moe(x)
    # first choices: expert 0 takes t0, t1, drops t2; 1 takes t3, t5; 2 takes t4. Second: t0->1 over (full),
    # t1->2 kept, t2->3 kept, t3->0 over, t4->3 kept, t5->2 over
    assert moe.tokens_per_expert.tolist() == [4, 3, 3, 2]
    assert moe.kept_per_expert.tolist() == [2, 2, 2, 2] and moe.dropped.item() == 4
    kept = {0: [0], 1: [0, 1], 2: [1], 3: [0], 4: [0, 1], 5: [0]}   # which choices each token keeps
    p = F.softmax(moe.router(x), -1)[0]
    for t, (i, j) in enumerate(zip(first, second)):
        g = p[t, [i, j]] / p[t, [i, j]].sum()
        want = sum(g[c] * moe.experts[(i, j)[c]](x[0, t]) for c in kept[t])
        assert torch.allclose(y[0, t], want, atol=1e-12)


def test_gpt_moe_shape_and_parameters():
    model = gpt_moe("gpt-moe-tiny", vocab_size=V, block_size=T, n_embd=32, n_head=2)
    assert len(moe_layers(model)) == 2 and model(torch.zeros(2, T, dtype=torch.long)).shape == (2, T, V)
    # per layer: router 32*4, 4 experts of 32*128+128 + 128*32+32; plus attention, norms, embeddings
    assert sum(p.numel() for p in model.parameters()) == 2 * (128 + 4 * 8352 + 4 * 1056 + 128) + V * 32 + T * 32 + 64


def test_bytes_formula_literals():
    # 8 tokens per rank, C = 8, top-1, 4 experts, 2 ranks, float64: 4 exchanges of 4 rows of 8 values of 8 bytes
    assert ExpertParallel.price(8, 8, 1, 4, 1, 2, bytes_per_element=8) == {"all_to_all": 1024, "counts": 16}
    assert ExpertParallel.price(512, 128, 2, 8, 2, 4) == {"all_to_all": 2 * 4 * 768 * 128 * 4, "counts": 2 * 48}
    assert dense_allreduce_bytes(1_000_000, 4) == 6_000_000
    # gpt-moe-tiny (vocab 96) on ep=2, 16 sequences of 128 tokens per rank, fp32: 4.2 MB of all-to-all plus the
    # all-reduce of its 163,072 non-expert parameters, beside gpt-tiny (the same compute per token: top-1 of
    # MLP-sized experts) on dp=2 all-reducing its 425,472
    assert ExpertParallel.price(16 * 128, 128, 1, 4, 2, 2) == {"all_to_all": 4_194_304, "counts": 32}
    moe, dense = gpt_moe("gpt-moe-tiny", 96), gpt("gpt-tiny", 96)
    shared = sum(p.numel() for p in moe.parameters()) - sum(p.numel() for m in moe_layers(moe)
                                                             for p in m.experts.parameters())
    assert (shared, dense_allreduce_bytes(shared, 2)) == (163_072, 652_288)
    assert dense_allreduce_bytes(sum(p.numel() for p in dense.parameters()), 2) == 1_701_888


def test_ep_refuses_a_model_it_cannot_spread():
    dim = ExpertParallel.__new__(ExpertParallel)        # check() reads only the size: no process group needed
    dim.size = 3
    with pytest.raises(ConfigError, match=r"^--mesh ep=3: gpt-moe-tiny has 4 experts per layer, not a multiple"):
        dim.check("gpt-moe-tiny")
    dim.size = 2
    dim.check("gpt-moe")
    with pytest.raises(ConfigError, match=r"^--mesh ep=2 spreads a mixture of experts; use --model gpt-moe-tiny"):
        dim.check("gpt-tiny")



@pytest.mark.parametrize("name", ["tp", "cp", "pp"])
def test_tp_cp_pp_refuse_a_mixture_of_experts_in_one_line(name):
    from labkit.models.moe import MOE_SIZES
    from labkit.parallel import get_dimension
    from labkit.parallel.base import MOE_MODELS

    assert MOE_MODELS == set(MOE_SIZES) == {"gpt-moe", "gpt-moe-tiny", "gpt-moe-tiny-top2", "gpt-moe-small"}
    dim = get_dimension(name).__new__(get_dimension(name))  # refused before check() reads the mesh
    dim.size, dim.options = 2, {}
    for model in sorted(MOE_MODELS):
        with pytest.raises(ConfigError, match=rf"^--mesh {name}=2 with --model {model} is not supported: "):
            dim.check(model)

# ----- ep=2 and dp=2,ep=2 against one process, through fit ------------------------------------------------

def _model(case: str):
    torch.manual_seed(0)
    return gpt_moe("gpt-moe-tiny", vocab_size=V, block_size=T, n_embd=32, n_head=2, aux_alpha=0.1,
                   **CASES[case]).double()


def _data():
    g = torch.Generator().manual_seed(1)
    # STEPS global batches of B, then 5 test sequences: 3 and 2 per data shard, 2 batches of 2 and 1 of 2 unpadded
    # (a shard with fewer batches would leave its ep peer waiting in the all-to-all forever)
    n = STEPS * B + 5
    x, y = torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)
    return TensorDataset(x[:-5], y[:-5]), TensorDataset(x[-5:], y[-5:])


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


def _fit(strategy, model, rename) -> dict:
    """labkit.train.loop.fit as ``labkit train`` calls it; every step's loss, tokens per expert and dropped choices,
    step 0's gradients after the synchronisation, the weights and test loss after STEPS steps."""
    from labkit.train.loop import fit

    out = {"loss": [], "tokens": [], "dropped": []}
    inner_fb, inner_sync = strategy.forward_backward, strategy.sync_gradients

    def forward_backward(*args):
        loss, logits = inner_fb(*args)
        out["loss"].append(loss.item())
        out["tokens"].append([m.tokens_per_expert.tolist() for m in moe_layers(model)])
        out["dropped"].append([m.dropped.item() for m in moe_layers(model)])
        return loss, logits

    out["sync_calls"] = []
    logged_sync = _logged_all_reduces(inner_sync, out["sync_calls"])

    def sync_gradients(m):
        logged_sync(m)
        out.setdefault("grads", {rename(n): p.grad.clone() for n, p in m.named_parameters()})

    strategy.forward_backward, strategy.sync_gradients = forward_backward, sync_gradients
    train, test = _data()
    task, shards = LanguageModelling(), strategy.data_parallel_size
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    history = fit(model, DataLoader(train, batch_size=B // shards, sampler=strategy.sampler(train, True, 3),
                                    drop_last=True),
                  DataLoader(test, batch_size=2, sampler=strategy.sampler(test, False, 3)), optimizer, epochs=1,
                  strategy=strategy, seed=3, criterion=task.criterion(), task=task, printer=lambda line: None)
    out["weights"] = {rename(n): p.detach().clone() for n, p in model.named_parameters()}
    out["test_loss"] = history[0]["test_loss"]
    return out


@functools.cache
def _single(case: str) -> dict:
    """The oracle: one process, the global batch (a one-replica DistributedSampler with the same seed draws the
    global batch s as the ranks' batches s together); once per case, whatever compares with it."""
    from labkit.strategies.base import Strategy

    strategy = Strategy(DistEnv())
    strategy.sampler = lambda data, train, seed: (DistributedSampler(data, num_replicas=1, rank=0, seed=seed)
                                                  if train else None)
    model = _model(case)
    return _fit(strategy, model, lambda n: n)


def _full(tensors: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in tensors.items()}


def _mesh_rank(env, mesh: str) -> dict:
    from labkit.parallel.mesh import MeshStrategy

    result = {}
    runs = [(case, case, {}) for case in CASES] + [("top1 recompute", "top1", {"recompute": "full"})]
    if mesh == "dp=2,ep=2":                  # top-2 with drops, with replicas and with FSDP2 over dp (DTensors)
        runs = [("top2-cap", "top2-cap", {}), ("top2-cap fsdp", "top2-cap", {"dp_shard": "fsdp"})]
    for key, case, options in runs:
        options = dict(options)
        recompute = options.pop("recompute", "none")  # full: each block replayed, its all-to-alls again
        strategy = MeshStrategy(env, {"mesh": mesh, **options})
        strategy.check_model("gpt-moe-tiny")
        model = strategy.prepare(set_recompute(_model(case), recompute))
        offset = moe_layers(model)[0].expert_offset
        result[key] = _fit(strategy, model, lambda n: re.sub(r"experts\.(\d+)",
                                                             lambda m: f"experts.{int(m[1]) + offset}", n))
        result[key]["grads"], result[key]["weights"] = _full(result[key]["grads"]), _full(result[key]["weights"])
    if mesh == "ep=2":                                       # the exchange's bytes with routing forced even
        moe = next(d for d in strategy.dims if d.name == "ep").parallelize(_forced_moe(1))
        x = torch.zeros(8, 8, dtype=torch.float64)
        x[torch.arange(8), torch.arange(8) % 4] = 3.0       # 2 tokens per expert on each rank
        x.requires_grad_()                                  # as in a GPT: the dispatch has a backward
        calls, original = [], torch.distributed.all_to_all_single

        def logged(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            row = tensor[:1].numel() * tensor.element_size()          # bytes per row sent
            calls.append([n * row for n in input_split_sizes or [len(tensor) // 2] * 2])
            return original(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        torch.distributed.all_to_all_single = logged
        try:
            moe(x[None]).sum().backward()
        finally:
            torch.distributed.all_to_all_single = original
        result["sent"], result["calls"] = moe.exchange.sent, calls
    return result


def _compare(per_rank: list[dict], ranks: int):
    for key in per_rank[0]:
        if key in ("sent", "calls"):
            continue
        case = key.split()[0]
        want = _single(case)
        runs = [r[key] for r in per_rank]
        assert len(want["loss"]) == STEPS and all(len(r["loss"]) == STEPS for r in runs)
        losses = [sum(r["loss"][s] for r in runs) / ranks for s in range(STEPS)]
        assert losses == pytest.approx(want["loss"], abs=1e-10)
        tokens = torch.tensor([r["tokens"] for r in runs]).sum(0)      # (STEPS, layers, E), routed on every rank
        assert tokens.tolist() == want["tokens"]
        assert torch.tensor([r["dropped"] for r in runs]).sum(0).tolist() == want["dropped"]
        if CASES[case]["capacity_factor"] is not None:
            assert min(min(d) for d in want["dropped"]) > 0    # the capacity does drop
        for what in ("grads", "weights"):
            for r in runs:
                assert r[what].keys() <= want[what].keys()
                for name, value in r[what].items():
                    torch.testing.assert_close(value, want[what][name], **TOL, msg=f"{key} {what} {name}")
            assert set().union(*(r[what] for r in runs)) == set(want[what])  # every expert lives on some rank
        assert all(r["test_loss"] == pytest.approx(want["test_loss"], abs=1e-10) for r in runs)


def test_ep2_equals_one_process():
    per_rank = run_ranks(_mesh_rank, 2, "ep=2")
    _compare(per_rank, 2)
    # per step one all-reduce of the 11,072 non-expert gradients over ep (1,536 + 512 embeddings, per layer 4,224
    # attention, 128 layer norms, 128 router, 64 ln_f)
    assert [r[case]["sync_calls"] for r in per_rank for case in CASES] == [[(11072, 2)] * STEPS] * 4
    # each rank: dispatch 4 rows, combine 4, both again in backward: 16 rows of 8 float64; counts 2 of 4 int64
    for r in per_rank:
        # bytes to rank 0 and rank 1 of each all_to_all_single, in call order: the counts (2 int64 each way),
        # dispatch, combine, combine's backward, dispatch's backward (4 rows of 8 float64 each way)
        assert r["calls"] == [[16, 16], [256, 256], [256, 256], [256, 256], [256, 256]]
        assert r["sent"] == {"rows": 16, "bytes": 1024, "count_bytes": 16}
        assert ExpertParallel.price(8, 8, 1, 4, 1, 2, bytes_per_element=8) == {"all_to_all": 1024, "counts": 16}


def test_dp2_ep2_equals_one_process():
    per_rank = run_ranks(_mesh_rank, 4, "dp=2,ep=2", timeout=240.0)
    assert sorted(per_rank[0]) == ["top2-cap", "top2-cap fsdp"]
    _compare(per_rank, 4)
    # per step: the non-expert gradients (11,072) averaged once over the flattened dp x ep group (4 ranks), the
    # rank's 2 experts of each of 2 layers (4 x 8,352 = 33,408) over dp (2 ranks); not ep's and then dp's
    assert [r["top2-cap"]["sync_calls"] for r in per_rank] == [[(11072, 4), (33408, 2)] * STEPS] * 4

"""The mesh's pp dimension (labkit.parallel.pp): a GPT and a CNN cut into stages, trained through the same
``labkit.train.loop.fit`` a user runs (``labkit.parallel.mesh.MeshStrategy``), each equal to single-process ``fit``
on the same global batch.

One spawn of 2 ranks (``--mesh pp=2``): a 2-block GPT (d=32, T=16, vocabulary 64, dropout 0) under GPipe and
1F1B, 3 steps of SGD with momentum (the loss every step, every weight after, both copies of the tied
embedding, the bytes each stage sends per step as literal numbers), a LeNet's nn.Sequential form (on the mesh and
through its preset ``--strategy pipeline``: the same sends, the same weights bit for bit), and the bad options. One spawn of 4 ranks: the GPT on ``tp=2,pp=2`` (and with ``--sequence-parallel``), a 4-block GPT on ``pp=4``
(middle stages without a copy of the embedding, the embedding group made with ``new_group``), the LeNet on
``dp=2,pp=2``, and ``cp=2,pp=2`` refused.

Tolerances (float32): the loss of every step within 1e-6 (only the order of the micro-batch and shard sums
changes), the weights after the last step within 1e-5; the tied embedding's two copies equal bit for bit.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.models.cnn import get_model
from labkit.models.gpt import GPT, GPTConfig
from labkit.parallel.pp import PipelineParallel, p2p_bytes_sent
from labkit.strategies.base import Strategy
from labkit.train.tasks import get_task

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
BATCH, STEPS = 8, 3  # global batch, steps of the one epoch


def _gpt(n_layer=2):
    torch.manual_seed(0)
    return GPT(CFG.replace(n_layer=n_layer))


def _lenet():
    torch.manual_seed(2)
    return get_model("lenet", image_size=16, sequential=True)


def _data(kind, n):
    g = torch.Generator().manual_seed(n)
    if kind == "lm":  # (N, T) token ids and targets
        return TensorDataset(*(torch.randint(0, CFG.vocab_size, (n, CFG.block_size), generator=g) for _ in "xy"))
    return TensorDataset(torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def _fit(strategy, model, kind, dp=1):
    """labkit.train.loop.fit as `labkit train` runs it: one epoch of STEPS global batches of BATCH (each of the data-
    parallel ranks a shard), evaluation; returns the loss every step, the bytes sent p2p every step and the
    epoch's record. One process stands for ``dp`` ranks with a one-replica DistributedSampler: the same
    permutation, so its global batch s is the ranks' batches s."""
    from labkit.parallel.pipeline_stages import torch_pipelining
    from labkit.train.loop import fit

    losses, sent, ops, inner = [], [], [], strategy.forward_backward
    schedules = torch_pipelining().schedules

    def recorded(*args):
        batch_p2p, step = schedules._batch_p2p, []

        def logged(batch, desc=None):  # every send and receive of the schedule: ("isend" | "irecv", elements)
            step.extend((op.op.__name__, op.tensor.numel()) for op in batch)
            return batch_p2p(batch, desc=desc)
        schedules._batch_p2p = logged
        try:
            with p2p_bytes_sent() as count:
                loss, out = inner(*args)
        finally:
            schedules._batch_p2p = batch_p2p
        losses.append(loss)
        sent.append(count["bytes"])
        ops.append(step)
        return loss, out
    strategy.forward_backward = recorded
    train = _data(kind, STEPS * BATCH)
    sampler = strategy.sampler(train, True, 0) or (DistributedSampler(train, 1, 0, seed=0) if dp > 1 else None)
    loader = DataLoader(train, batch_size=BATCH // strategy.data_parallel_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = fit(model, loader, DataLoader(_data(kind, 10), batch_size=5), optimizer, epochs=1, strategy=strategy,
                  task=get_task(kind), printer=lambda line: None)
    return {"losses": losses, "sent": sent, "ops": ops, "record": history[0]}


def _full(local, like, group):
    """A tp shard gathered back to the whole tensor (along the dim whose size differs from ``like``'s)."""
    if local.shape == like.shape:
        return local
    dim = next(d for d, (a, b) in enumerate(zip(local.shape, like.shape)) if a != b)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim)


@functools.cache
def _oracle(kind, dp=1, n_layer=2):
    """One process through fit (its results and model), once per model and data: every mesh reads it."""
    reference = _gpt(n_layer) if kind == "lm" else _lenet()
    return _fit(Strategy(DistEnv()), reference, kind, dp), reference


def _run(env, mesh, kind, dp=1, n_layer=2, preset=None, **options):
    """Train on ``mesh`` (or with the ``--strategy`` ``preset`` of it) and in one process; this rank's results beside
    the single process's."""
    from labkit.parallel.mesh import MeshStrategy
    from labkit.strategies import get_strategy

    options = {"num_microbatches": 2, **options}
    strategy = get_strategy(preset)(env, options) if preset else MeshStrategy(env, {"mesh": mesh, **options})
    stage = strategy.prepare(_gpt(n_layer) if kind == "lm" else _lenet())
    got = _fit(strategy, stage, kind)
    ref, reference = _oracle(kind, dp, n_layer)
    pp, tp = strategy.pipeline, strategy.mesh.get_group("tp")
    if kind == "lm":  # parameter names are the whole model's; tp shards gathered back
        ref_state = reference.state_dict()
        weights = {n: (_full(p.detach(), ref_state[n], tp), ref_state[n]) for n, p in stage.named_parameters()}
        tied = stage.tied_weight()
        tied = None if tied is None else _full(tied.detach(), reference.tok_emb.weight, tp)
    else:
        start = sum(pp.balance[:pp.rank])
        mine = reference[start:start + pp.balance[pp.rank]]
        weights = dict(enumerate(zip(stage.parameters(), mine.parameters(), strict=True)))
        tied = None
    return {"got": got, "ref": ref, "weights": weights, "tied": tied, "stage": pp.rank, "balance": pp.balance,
            "ref_names": [n for n, _ in reference.named_parameters()],
            "owner": strategy.metric_owner(), "data": strategy.data_shard()}


def _two_ranks(env):
    from labkit.parallel.mesh import MeshStrategy

    out = {schedule: _run(env, "pp=2", "lm", schedule=schedule) for schedule in ("gpipe", "1f1b")}
    out["cnn"] = _run(env, "pp=2", "classification", schedule="1f1b")
    out["preset"] = _run(env, "pp=2", "classification", preset="pipeline", schedule="1f1b")
    out["errors"] = []
    for options in ({"schedule": "1f1b", "num_microbatches": 1}, {"balance": [1]}, {"balance": [2, 1]}):
        try:
            MeshStrategy(env, {"mesh": "pp=2", **options}).check_model("gpt-tiny")
        except ConfigError as exc:
            out["errors"].append(str(exc))
    return out


def _four_ranks(env):
    from labkit.dist.mesh import build_mesh

    try:
        PipelineParallel(build_mesh({"cp": 2, "pp": 2}), {}).check("gpt-tiny")
    except ConfigError as exc:
        refused = str(exc)
    return {"refused": refused, "tp": _run(env, "tp=2,pp=2", "lm", schedule="gpipe"),
            "tp_sp": _run(env, "tp=2,pp=2", "lm", schedule="1f1b", sequence_parallel=True),
            "cnn": _run(env, "dp=2,pp=2", "classification", dp=2, schedule="gpipe"),
            "pp4": _run(env, "pp=4", "lm", n_layer=4, schedule="1f1b", num_microbatches=4)}


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_ranks, 2, timeout=300)


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout=300)


def _check(runs, owners):
    """The owners' losses (mean over data shards) every step, every rank's weights and epoch record."""
    losses = torch.stack([torch.stack(r["got"]["losses"]) for r in runs if r["owner"]]).mean(0)
    assert len(owners) == sum(r["owner"] for r in runs) and all(runs[i]["owner"] for i in owners)
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, torch.stack(runs[0]["ref"]["losses"]), rtol=0, atol=1e-6)
    for r in runs:
        if r["stage"] == 0:
            assert r["got"]["losses"] == [None] * STEPS  # only the last stage has the loss
        for name, (got, ref) in r["weights"].items():
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=str(name))
        for key in ("train_loss", "test_loss"):
            assert r["got"]["record"][key] == pytest.approx(r["ref"]["record"][key], abs=1e-5)


def _check_tied(first, last):
    """The tied matrix's two copies: equal bit for bit (each got the summed gradient), and the one model's."""
    assert torch.equal(first["tied"], last["tied"])
    torch.testing.assert_close(last["tied"], last["weights"]["head.weight"][1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_on_pp2_equals_one_process(two, schedule):
    first, last = two[0][schedule], two[1][schedule]
    _check([first, last], owners=[1])
    assert first["balance"] == [1, 1] and last["balance"] == [1, 1]
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.attn.q.weight"} <= set(first["weights"])
    assert {"blocks.1.mlp.fc.weight", "ln_f.weight", "head.weight"} <= set(last["weights"])
    assert not set(first["weights"]) & set(last["weights"])
    _check_tied(first, last)


def test_cnn_on_pp2_equals_one_process(two):
    _check([two[0]["cnn"], two[1]["cnn"]], owners=[1])
    assert two[0]["cnn"]["got"]["record"]["test_acc"] == two[0]["cnn"]["ref"]["record"]["test_acc"]


def test_strategy_pipeline_is_the_pp2_mesh(two):
    """--strategy pipeline, the preset of --mesh pp=2: the same sends and receives every step, the same losses and
    weights bit for bit, and so the one process's within the tolerances above."""
    preset, mesh = [r["preset"] for r in two], [r["cnn"] for r in two]
    _check(preset, owners=[1])
    for p, m in zip(preset, mesh):
        assert p["got"]["ops"] == m["got"]["ops"] and p["got"]["sent"] == m["got"]["sent"]
        # a step after the first, 1F1B: the 2 micro-batches' activations at the cut (64 values each) forward, their
        # gradients back; the last stage returns each gradient as soon as its micro-batch has arrived
        send, receive = ("isend", 64), ("irecv", 64)
        assert p["got"]["ops"][1] == ([send, send, receive, receive] if p["stage"] == 0 else [receive, send] * 2)
        assert p["balance"] == m["balance"]
        for name, (got, _) in p["weights"].items():
            assert torch.equal(got, m["weights"][name][0]), name
    assert torch.equal(torch.stack(preset[1]["got"]["losses"]), torch.stack(mesh[1]["got"]["losses"]))


def test_gpt_on_tp2_pp2_equals_one_process(four):
    for key in ("tp", "tp_sp"):
        runs = [r[key] for r in four]
        # mesh order (pp, dp, ep, cp, tp): ranks 0, 1 are stage 0's tp pair, 2, 3 stage 1's; rank 2 counts
        assert [r["stage"] for r in runs] == [0, 0, 1, 1]
        _check(runs, owners=[2])
        _check_tied(runs[0], runs[2])
        _check_tied(runs[1], runs[3])


def test_gpt_on_pp4_equals_one_process(four):
    runs = [r["pp4"] for r in four]
    assert [r["stage"] for r in runs] == [0, 1, 2, 3] and runs[0]["balance"] == [1, 1, 1, 1]
    _check(runs, owners=[3])
    assert runs[1]["tied"] is None and runs[2]["tied"] is None  # middle stages: blocks only
    assert set(runs[1]["weights"]) == {n for n in runs[0]["ref_names"] if n.startswith("blocks.1.")}
    _check_tied(runs[0], runs[3])


def test_cnn_on_dp2_pp2_equals_one_process_on_the_global_batch(four):
    runs = [r["cnn"] for r in four]
    assert [(r["stage"], r["data"]) for r in runs] == [(0, (2, 0)), (0, (2, 1)), (1, (2, 0)), (1, (2, 1))]
    _check(runs, owners=[2, 3])


def test_bytes_per_step_are_the_formulas():
    # B=8, T=16, C=32, float32, V=64: 2 directions x (8 x 16 x 32 x 4 bytes) + the (64, 32) copy from each of 2
    price = PipelineParallel.price(batch=8, seq_len=16, n_embd=32, vocab_size=64, num_stages=2)
    assert price == {"activations": 32768, "embedding": 16384, "total": 49152}
    sp = PipelineParallel.price(8, 16, 32, 64, num_stages=2, tp=2, sequence_parallel=True)
    assert sp == {"activations": 16384, "embedding": 8192, "total": 24576}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_sends_what_the_formula_says(two, four, schedule):
    # after the first step (whose one-time shape exchange is no p2p batch): per step, stage 0 sends the 2
    # micro-batches' (4, 16, 32) float32 activations forward, 16,384 bytes, and stage 1 their gradients back
    for rank in two:
        assert rank[schedule]["got"]["sent"][1:] == [16384] * (STEPS - 1)
    # tp=2: each tp rank sends the same full activations; with sequence parallelism its (4, 8, 32) half
    assert [r["tp"]["got"]["sent"][1:] for r in four] == [[16384] * (STEPS - 1)] * 4
    assert [r["tp_sp"]["got"]["sent"][1:] for r in four] == [[8192] * (STEPS - 1)] * 4
    assert two[0][schedule]["tied"].numel() * 4 == 8192  # the embedding all-reduce: 8,192 bytes from each rank


def test_bad_pp_options_are_one_clear_line_before_any_work(two):
    assert two[0]["errors"] == two[1]["errors"] == [
        "--schedule 1f1b needs --num-microbatches >= the number of stages (pp=2), got 1",
        "--balance 1 gives 1 stage(s) but pp=2; give one count per stage",
        "--balance 2 1 sums to 3 but the model has 2 layers; give layer counts that add up to 2"]


def test_pp_flags_literal_agrees_with_the_schedules():
    from labkit.flags import read_flags
    from labkit.parallel import pp
    from labkit.parallel.pipeline_stages import SCHEDULES

    assert read_flags("labkit.parallel.pp") == tuple(pp.FLAGS)
    assert tuple(next(f["choices"] for f in pp.FLAGS if f["flag"] == "--schedule")) == tuple(SCHEDULES)


def test_pp_with_cp_is_refused(four):
    assert [r["refused"] for r in four] == ["--mesh pp=2 with cp > 1 is not supported: a pipeline stage computes the "
                                            "positions itself, not cp's; use pp or cp"] * 4

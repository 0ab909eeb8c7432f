"""labkit's pipeline schedules run from their data (labkit.parallel.pp_runtime, ``--pp-schedule``), in ONE spawn of 4
gloo ranks:

* through the ``fit`` a user runs (``MeshStrategy``, 3 steps of SGD with momentum, an 8-block GPT, d=32, T=8,
  vocabulary 64, dropout 0): ``pp=4`` under zb-h1, interleaved-1f1b (v=2), zbv and dualpipev, ``dp=2,pp=2`` under zbv
  and ``tp=2,pp=2`` under zb-h1, and a LeNet's ``nn.Sequential`` on ``pp=4`` under zb-h1, each equal to one process (the loss every step within 1e-6, every weight after within
  1e-5: only the order of the micro-batch sums changes);
* against ``torch.distributed.pipelining``'s schedule of the same name (ScheduleInterleaved1F1B,
  ScheduleInterleavedZeroBubble with one stage per rank for zb-h1, ScheduleZBVZeroBubble, ScheduleDualPipeV): the same
  model (its head untied: torch's V schedules get the tied matrix's gradient wrong when one rank holds both of its
  uses) and micro-batches give the same per-micro-batch losses and every gradient within 1e-6.

The pure half (B then W equals the ordinary backward, the bad flags) needs no ranks.
"""
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.models.cnn import get_model
from labkit.models.gpt import GPT, GPTConfig
from labkit.parallel.pp_gpt import GPTStage
from labkit.parallel.pp_runtime import ScheduleRuntime, SplitBackward
from labkit.strategies.base import Strategy
from labkit.train.tasks import get_task

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=8, n_head=2, n_embd=32, dropout=0.0)
BATCH, STEPS = 8, 3


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _data(n, seed=1, kind="lm"):
    g = torch.Generator().manual_seed(seed)
    if kind == "lm":  # (N, T) token ids and targets
        return TensorDataset(*(torch.randint(0, CFG.vocab_size, (n, CFG.block_size), generator=g) for _ in "xy"))
    return TensorDataset(torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def _lenet():
    torch.manual_seed(2)
    return get_model("lenet", image_size=16, sequential=True)  # 12 layers: 3 per stage on pp=4


def _criterion(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _fit(strategy, model, kind="lm"):
    from labkit.train.loop import fit

    losses, inner = [], strategy.forward_backward

    def recorded(*args):
        loss, out = inner(*args)
        losses.append(loss)
        return loss, out
    strategy.forward_backward = recorded
    train = _data(STEPS * BATCH, kind=kind)
    world, index = strategy.data_shard() if hasattr(strategy, "data_shard") else (1, 0)
    # one permutation for every run: data-parallel rank i reads its every other sample, one process all of them
    sampler = DistributedSampler(train, world, index, seed=0)
    loader = DataLoader(train, batch_size=BATCH // world, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fit(model, loader, DataLoader(_data(8, 2, kind), batch_size=8), optimizer, epochs=1, strategy=strategy,
        task=get_task(kind), printer=lambda line: None)
    return losses


def _mesh_run(env, mesh, kind="lm", **options):
    """Train on ``mesh`` with the options; this rank's losses, weights (whole-model names, tp shards gathered) and
    whether it owns the metrics."""
    from labkit.parallel.mesh import MeshStrategy

    strategy = MeshStrategy(env, {"mesh": mesh, **options})
    model = strategy.prepare(_gpt() if kind == "lm" else _lenet())
    losses = _fit(strategy, model, kind)
    tp = strategy.mesh.get_group("tp")
    weights = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        local = p.detach()
        if strategy.mesh.size(strategy.mesh.mesh_dim_names.index("tp")) > 1:
            parts = [torch.empty_like(local) for _ in range(2)]
            torch.distributed.all_gather(parts, local.contiguous(), group=tp)
            local = parts
        weights[name] = local
    return {"losses": losses, "weights": weights, "owner": strategy.metric_owner()}


def _torch_run(env, name, cls, chunks, m):
    """One step of this rank's stages under labkit's runtime and under torch's ``cls``: per-micro-batch losses and
    gradients of each."""
    from torch.distributed.pipelining import PipelineStage

    x, y = _data(BATCH, 3).tensors
    out = {}
    for who in ("labkit", "torch"):
        model = _gpt()
        # untied: torch's V schedules (ZBV, DualPipeV) put the embedding and the head on rank 0, and their weight
        # gradient of one matrix used by two stages of a rank is not the one-process gradient (labkit's is)
        model.head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
        runtime = ScheduleRuntime(env.rank, env.world_size, name, chunks, m, torch.device("cpu"))
        cut = env.world_size * chunks
        mine = runtime.schedule.stages_of(env.rank)
        stages = {s: GPTStage(model, [CFG.n_layer // cut] * cut, s) for s in mine}
        losses = []
        if who == "labkit":
            runtime.forward_backward(stages, x, y, _criterion)
            if runtime.holds(runtime.last_stage):  # the runtime's own per-micro-batch losses, recomputed alike
                with torch.no_grad():
                    losses = [_criterion(model(xi), yi) for xi, yi in zip(x.chunk(m), y.chunk(m))]
        else:
            pipe = [PipelineStage(stages[s], s, cut, torch.device("cpu")) for s in mine]
            schedule = cls(pipe, m, loss_fn=_criterion)
            holds_first, holds_last = 0 in mine, cut - 1 in mine
            kwargs = {"target": y, "losses": losses} if holds_last else {}
            schedule.step(*((x,) if holds_first else ()), **kwargs)
        out[who] = {"losses": [loss.detach() for loss in losses],
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    return out


def _ranks(env):
    import torch.distributed.pipelining as pp

    runs = {
        "zb-h1": _mesh_run(env, "pp=4", pp_schedule="zb-h1", num_microbatches=4),
        "interleaved-1f1b": _mesh_run(env, "pp=4", pp_schedule="interleaved-1f1b", pp_virtual=2, num_microbatches=4),
        "zbv": _mesh_run(env, "pp=4", pp_schedule="zbv", num_microbatches=8),
        "dualpipev": _mesh_run(env, "pp=4", pp_schedule="dualpipev", num_microbatches=8),
        "dp2-zbv": _mesh_run(env, "dp=2,pp=2", pp_schedule="zbv", num_microbatches=4),
        "tp2-zb-h1": _mesh_run(env, "tp=2,pp=2", pp_schedule="zb-h1", num_microbatches=2),
        "cnn-zb-h1": _mesh_run(env, "pp=4", "classification", pp_schedule="zb-h1", num_microbatches=4),
    }
    torch_runs = {
        "interleaved-1f1b": _torch_run(env, "interleaved-1f1b", pp.ScheduleInterleaved1F1B, 2, 4),
        "zb-h1": _torch_run(env, "zb-h1", pp.ScheduleInterleavedZeroBubble, 1, 4),
        "zbv": _torch_run(env, "zbv", pp.ScheduleZBVZeroBubble, 2, 8),
        "dualpipev": _torch_run(env, "dualpipev", pp.ScheduleDualPipeV, 2, 8),
    }
    return {"runs": runs, "torch": torch_runs}


@pytest.fixture(scope="module")
def four():
    return run_ranks(_ranks, 4, timeout=300)


@pytest.fixture(scope="module")
def oracles():
    """One process through the same fit, the GPT and the LeNet: the loss every step and the weights after."""
    out = {}
    for kind, model in (("lm", _gpt()), ("classification", _lenet())):
        losses = _fit(Strategy(DistEnv()), model, kind)
        out[kind] = {"losses": torch.stack(losses), "weights": dict(model.named_parameters(remove_duplicate=False))}
    return out


@pytest.mark.parametrize("key", ["zb-h1", "interleaved-1f1b", "zbv", "dualpipev", "dp2-zbv", "tp2-zb-h1",
                                 "cnn-zb-h1"])
def test_schedule_from_data_equals_one_process(four, oracles, key):
    oracle = oracles["classification" if key.startswith("cnn") else "lm"]
    runs = [r["runs"][key] for r in four]
    owners = [r for r in runs if r["owner"]]
    # V-shaped schedules put the last stage on rank 0 of each pp column; the others on its last rank
    expected = {"zbv": [0], "dualpipev": [0], "dp2-zbv": [0, 1], "tp2-zb-h1": [2]}.get(key, [3])
    assert [i for i, r in enumerate(runs) if r["owner"]] == expected
    losses = torch.stack([torch.stack(r["losses"]) for r in owners]).mean(0)
    torch.testing.assert_close(losses, oracle["losses"].detach(), rtol=0, atol=1e-6)
    seen = set()
    for r in runs:
        for name, got in r["weights"].items():
            ref = oracle["weights"][name].detach()
            if isinstance(got, list):  # tp shards: concatenated along the dimension that was split
                dim = next((d for d, (a, b) in enumerate(zip(got[0].shape, ref.shape)) if a != b), None)
                got = got[0] if dim is None else torch.cat(got, dim)
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=f"{key}: {name}")
            seen.add(name)
    assert seen == set(oracle["weights"])  # every weight of the model lives on some rank


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-h1", "zbv", "dualpipev"])
def test_same_losses_and_gradients_as_torch_pipelining(four, name):
    for rank in four:
        ours, theirs = rank["torch"][name]["labkit"], rank["torch"][name]["torch"]
        assert len(ours["losses"]) == len(theirs["losses"])
        for a, b in zip(ours["losses"], theirs["losses"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert set(ours["grads"]) == set(theirs["grads"]) and ours["grads"]
        for n in ours["grads"]:
            torch.testing.assert_close(ours["grads"][n], theirs["grads"][n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("make", ["gpt", "lenet"])
def test_b_then_w_equals_the_ordinary_backward(make):
    """SplitBackward on one process: B gives the input's gradient and leaves every .grad empty; W then fills each
    parameter's .grad with exactly what one backward() gives."""
    torch.manual_seed(0)
    if make == "gpt":
        model, x = GPTStage(_gpt(), [4, 4], 1), torch.randn(2, CFG.block_size, CFG.n_embd)
    else:
        model, x = get_model("lenet", image_size=16, sequential=True)[3:], torch.randn(4, 6, 6, 6)
    x.requires_grad_()
    out = model(x)
    g = torch.randn_like(out)
    out.backward(g)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected_input = x.grad.clone()
    model.zero_grad(set_to_none=True)

    split = SplitBackward([model])
    inp = x.detach().requires_grad_()
    out, edges = split.forward(model, inp)
    assert len(edges) == len(split.owners) > 0
    dinp, saved = SplitBackward.input_grad(out, g, inp, edges)
    assert all(p.grad is None for p in model.parameters())  # B wrote no weight gradient
    torch.testing.assert_close(dinp, expected_input, rtol=0, atol=1e-6)
    SplitBackward.weight_grad(saved)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("options, message", [
    ({"pp_schedule": "zb-h1", "num_microbatches": 2}, "--pp-schedule zb-h1 needs --num-microbatches >= 4 with pp=4, got 2"),
    ({"pp_schedule": "zbv", "pp_virtual": 3, "num_microbatches": 8},
     "--pp-schedule zbv runs two chunks per rank, in a V: use --pp-virtual 2, not 3"),
    ({"pp_virtual": 2}, "--pp-virtual 2 needs --pp-schedule"),
    ({"pp_schedule": "interleaved-1f1b", "num_microbatches": 6}, "must be a multiple of pp=4, got 6"),
    ({"pp_schedule": "1f1b", "schedule": "1f1b"}, "--pp-schedule 1f1b and --schedule 1f1b both name the schedule"),
    ({"pp_schedule": "zb-h1", "dp_shard": "fsdp"}, "--pp-schedule zb-h1 with --dp-shard fsdp"),
    ({"pp_schedule": "interleaved-1f1b", "pp_virtual": 3, "num_microbatches": 4, "balance": [1] * 8},
     "gives 8 stage(s) but pp=4 × --pp-virtual 3 = 12 chunks"),
])
def test_bad_schedule_options_are_one_line(options, message):
    from labkit.parallel.pipeline_stages import pipeline_options

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeline_options({"num_microbatches": 4, **options}, 4)


def test_chunks_that_do_not_divide_the_blocks_are_refused():
    """pp=2 × v=2 = 4 chunks of gpt-small's 6 blocks: one line, before any work; 8 blocks cut into 4 equal chunks."""
    from labkit.parallel.pp import PipelineParallel

    pp = PipelineParallel.__new__(PipelineParallel)
    pp.size, pp.virtual, pp.options = 2, 2, {}
    with pytest.raises(ConfigError, match=r"--mesh pp=2 × --pp-virtual 2 = 4 chunks do not divide gpt-small's 6 "
                                          r"blocks; choose v so that pp·v divides 6, or give --balance with 4 counts"):
        pp._balance(6, "blocks", "gpt-small")
    assert pp._balance(8, "blocks", "the GPT") == [2, 2, 2, 2]

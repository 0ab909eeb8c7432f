"""labkit.parallel.mesh on gloo CPU ranks: each composition, through the same ``labkit.train.loop.fit`` a user runs,
equals single-process ``fit`` on the global batch; mesh checkpoints resume bit-identically; a mesh that does not
reshard is refused on resume (resharding: ``tests/test_sync_reshard.py``).

One 2-rank spawn runs several fits in turn: a CNN on ``--mesh dp=2`` (replicas + bucketed all-reduce; and with
``--allreduce ring``, labkit's ring over the dp group), on
``dp=2 --dp-shard fsdp`` (FSDP2 over the mesh's dp group) and on ``dp=2 --dp-shard zero3`` (labkit's ZeRO over
it), a 2-layer GPT (d=32, T=16, vocabulary 64, dropout 0) on ``dp=2``, ``pp=2``, ``tp=2``, ``tp=2 --sequence-parallel`` and ``cp=2`` (ring attention alone), and with ``--recompute full``
on ``pp=2 --pp-schedule zb-h1`` (each block replayed in B and again in W), against the same oracle (recompute
changes nothing but memory); the CNN on
fsdp runs two epochs and is resumed from the checkpoint it wrote after the first, that checkpoint offered to
another mesh; the CNN on zero3 the same (its parameters gathered over dp to be saved, loaded and compared). One 4-rank spawn: the GPT on ``dp=2,tp=2``, on ``dp=2,tp=2 --dp-shard fsdp`` (FSDP2 x TP; and with
``--recompute full``: the replay gathers the blocks' shards again; and with ``--sequence-parallel``: the layer
norms', row biases' and position table's gradients, FSDP2's dp shards by then, summed over tp), on
``tp=2,pp=2``, on ``dp=2,tp=2 --dp-shard zero2`` and ``dp=2,pp=2 --dp-shard zero1`` (labkit's ZeRO over the dp
groups); the GPT on ``dp=2,tp=2`` resumed the same way, its checkpoint offered to ``dp=2,tp=2 --dp-shard zero1``. One 8-rank
spawn: ``dp=2,tp=2,pp=2``. (The CNN on ``pp=2`` and ``dp=2,pp=2`` is ``tests/test_pp.py``'s.) Each fit is
one epoch of 2 steps (with evaluation), the two resumed ones two epochs.

The oracle: one process, the global batch, in the ranks' sample order. A step's global loss is the mean of the
losses of the ranks that own metrics, one per data shard. Tolerances (float32): the loss of every step within
1e-6 absolute (only the order of the sums changes), the weights after the last step within 1e-5; a resumed
run's weights are bit-identical (==) to those of the run that was not interrupted.
"""
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from labkit.data.loader import make_loader
from labkit.dist.group import DistEnv
from labkit.dist.testing import record_losses, run_ranks
from labkit.errors import CheckpointError, ConfigError
from labkit.models.gpt import GPT, GPTConfig
from labkit.models.recompute import set_recompute
from labkit.optim import OptimizerSpec
from labkit.parallel.dp import fsdp_refusal
from labkit.strategies.base import Strategy
from labkit.train.tasks import LanguageModelling, Task

GLOBAL_BATCH, SEED, LR = 8, 5, 0.1
STEPS = {"cnn": 2, "gpt": 2}  # steps per epoch: the second is the first with momentum
#: a composition runs one epoch; the two a resume checks run two (a checkpoint at the first epoch's end, the
#: second resumed from it), so the sampler's second epoch and the restored optimizer state are compared too
EPOCHS, RESUMED_EPOCHS = 1, 2
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)


def _data(kind: str):
    g = torch.Generator().manual_seed(0)
    n = STEPS[kind] * GLOBAL_BATCH
    if kind == "cnn":
        return (TensorDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 5, (n,), generator=g)),
                TensorDataset(torch.randn(6, 1, 4, 4, generator=g), torch.randint(0, 5, (6,), generator=g)))
    tokens = torch.randint(0, CFG.vocab_size, (n + 4, CFG.block_size + 1), generator=g)
    return TensorDataset(tokens[:n, :-1], tokens[:n, 1:]), TensorDataset(tokens[n:, :-1], tokens[n:, 1:])


def _model(kind: str) -> nn.Module:
    torch.manual_seed(1)
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 5))
    return GPT(CFG)


def _task(kind: str) -> Task:
    return Task() if kind == "cnn" else LanguageModelling()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by name (an FSDP shard gathered over dp: what this rank's tp/pp part holds)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def _fit(strategy, model, kind, epochs, start_epoch=0, out=None, resume=False):
    """labkit.train.loop.fit as ``labkit train`` calls it; with ``out``: a checkpoint there after the first epoch (the
    one ``labkit train`` writes at each epoch's end), or with ``resume`` the run resumed from it."""
    from labkit.train.checkpoint import load_training_state, save_training_state
    from labkit.train.loop import fit

    train, test = _data(kind)
    optimizer, _ = strategy.build_optimizer(model, OptimizerSpec("sgd", LR, 0.9))  # ZeRO: over its shards
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if resume:
        load_training_state(strategy.checkpoint_file(out), strategy, model, optimizer, scheduler, None)

    def save(epoch):
        if out is not None and not resume and epoch == 0:
            save_training_state(strategy.checkpoint_file(out), strategy, model, optimizer, scheduler, None,
                                {"epoch": epoch + 1}, {})
    losses = record_losses(strategy)
    task = _task(kind)
    dp = strategy.data_parallel_size  # the training loader exactly as labkit.train.run builds it
    fit(model, make_loader(train, GLOBAL_BATCH // dp, shuffle=True, sampler=strategy.sampler(train, True, SEED),
                           seed=SEED, drop_last=dp > 1),
        DataLoader(test, batch_size=3, sampler=strategy.sampler(test, False, SEED)), optimizer, epochs=epochs,
        start_epoch=start_epoch, strategy=strategy, seed=SEED, scheduler=scheduler, criterion=task.criterion(),
        task=task, printer=lambda line: None, on_epoch_end=save)
    return losses


def _run(env, kind: str, options: dict, out=None) -> dict:
    """One composition through fit: this rank's losses, weights, data shard and metric ownership; with ``out``,
    its checkpoint after the first of its two epochs there."""
    from labkit.parallel.mesh import MeshStrategy

    options = dict(options)
    recompute = options.pop("recompute", "none")  # labkit train --recompute: set on the model it builds
    strategy = MeshStrategy(env, options)
    strategy.check_model("gpt-tiny" if kind == "gpt" else "lenet")
    model = strategy.prepare(set_recompute(_model(kind), recompute))
    epochs = EPOCHS if out is None else RESUMED_EPOCHS
    losses = _fit(strategy, model, kind, epochs, out=out)
    with strategy.whole_parameters():  # --dp-shard zero3: gathered over dp
        weights = _weights(strategy.unwrap(model))
    return dict(losses=losses, epochs=epochs, weights=weights, data=strategy.data_shard(), owner=strategy.metric_owner(),
                coords={d.name: d.rank for d in strategy.dims}, sizes={d.name: d.size for d in strategy.dims})


def _single(kind: str, epochs: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], set[str]]:
    """The oracle: fit in one process on the global batch, its loader built as ``labkit train`` builds it; its
    shuffle is the ranks' global order (labkit.data.loader.global_order), so global batch s is the ranks' batches s
    in every shuffled step of every epoch.
    Returns the losses, the weights by every name (state_dict) and the parameters' names."""
    model = _model(kind)
    strategy = Strategy(DistEnv())
    losses = _fit(strategy, model, kind, epochs)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}  # a tied head under both names
    return torch.stack(losses), state, set(_weights(model))


#: (kind, options) of each composition, by the spawn that runs it
TWO = {"cnn dp=2": ("cnn", {"mesh": "dp=2"}),
       "cnn dp=2 fsdp": ("cnn", {"mesh": "dp=2", "dp_shard": "fsdp"}),
       "cnn dp=2 zero3": ("cnn", {"mesh": "dp=2", "dp_shard": "zero3"}),
       "cnn dp=2 ring": ("cnn", {"mesh": "dp=2", "allreduce": "ring"}),
       "gpt dp=2": ("gpt", {"mesh": "dp=2"}),
       "gpt pp=2": ("gpt", {"mesh": "pp=2", "num_microbatches": 2}),
       "gpt tp=2": ("gpt", {"mesh": "tp=2"}),
       "gpt tp=2 sp": ("gpt", {"mesh": "tp=2", "sequence_parallel": True}),
       "gpt cp=2": ("gpt", {"mesh": "cp=2"}),
       "gpt pp=2 zb-h1 recompute full": ("gpt", {"mesh": "pp=2", "num_microbatches": 2, "pp_schedule": "zb-h1",
                                                 "recompute": "full"})}
FOUR = {"gpt dp=2,tp=2": ("gpt", {"mesh": "dp=2,tp=2"}),
        "gpt dp=2,tp=2 fsdp": ("gpt", {"mesh": "dp=2,tp=2", "dp_shard": "fsdp"}),
        "gpt dp=2,tp=2 fsdp recompute full": ("gpt", {"mesh": "dp=2,tp=2", "dp_shard": "fsdp", "recompute": "full"}),
        "gpt dp=2,tp=2 fsdp sp": ("gpt", {"mesh": "dp=2,tp=2", "dp_shard": "fsdp", "sequence_parallel": True}),
        "gpt tp=2,pp=2": ("gpt", {"mesh": "tp=2,pp=2", "num_microbatches": 2}),
        "gpt dp=2,tp=2 zero2": ("gpt", {"mesh": "dp=2,tp=2", "dp_shard": "zero2"}),
        "gpt dp=2,pp=2 zero1": ("gpt", {"mesh": "dp=2,pp=2", "dp_shard": "zero1", "num_microbatches": 2})}
#: FSDP2 runs on CPU ranks from torch 2.7 on (labkit refuses it before, labkit.parallel.dp.fsdp_refusal): its
#: compositions and its resume are left out on an older torch
FSDP_ON_CPU = fsdp_refusal("--strategy fsdp", "cpu") is None
TWO = {key: run for key, run in TWO.items() if FSDP_ON_CPU or "fsdp" not in key}
FOUR = {key: run for key, run in FOUR.items() if FSDP_ON_CPU or "fsdp" not in key}
EIGHT = {"gpt dp=2,tp=2,pp=2": ("gpt", {"mesh": "dp=2,tp=2,pp=2", "num_microbatches": 2})}


def _resume(env, kind: str, options: dict, other: dict, out: str, straight: dict) -> dict:
    """The second epoch resumed from the checkpoint in ``out`` that the run on ``options`` wrote after its first,
    beside ``straight`` (that run's weights after both epochs, run without a stop); that checkpoint offered to a
    run on the mesh ``other``. Returns both runs' weights and the refusal."""
    from labkit.parallel.mesh import MeshStrategy

    result = {"straight": straight}
    again = MeshStrategy(env, options)
    model = again.prepare(_model(kind))
    _fit(again, model, kind, RESUMED_EPOCHS, start_epoch=1, out=out, resume=True)
    with again.whole_parameters():
        result["resumed"] = _weights(model)
    wrong = MeshStrategy(env, other)
    try:
        _fit(wrong, wrong.prepare(_model(kind)), kind, RESUMED_EPOCHS, start_epoch=1, out=out, resume=True)
    except CheckpointError as exc:
        result["mismatch"] = str(exc)
    return result


def _two_ranks(env, out):
    """On each of 2 ranks: the TWO compositions; a CNN on dp=2 --dp-shard fsdp resumed, and its checkpoint
    offered to dp=2 without sharding; the same with zero3, offered to zero1; --allreduce ring with zero2 refused."""
    from labkit.parallel.mesh import MeshStrategy

    result = _runs(env, TWO, "cnn dp=2 fsdp" if FSDP_ON_CPU else None, out)
    if FSDP_ON_CPU:
        result["resume"] = _resume(env, "cnn", {"mesh": "dp=2", "dp_shard": "fsdp"}, {"mesh": "dp=2"}, out,
                                   result["cnn dp=2 fsdp"]["weights"])
    zero3, zero_out = {"mesh": "dp=2", "dp_shard": "zero3"}, os.path.join(out, "zero3")
    os.makedirs(zero_out, exist_ok=True)
    straight = _run(env, "cnn", zero3, zero_out)["weights"]
    result["resume zero3"] = _resume(env, "cnn", zero3, {"mesh": "dp=2", "dp_shard": "zero1"}, zero_out, straight)
    try:
        MeshStrategy(env, {"mesh": "dp=2", "dp_shard": "zero2", "allreduce": "ring"})
    except ConfigError as exc:
        result["ring zero2"] = str(exc)
    return result


def _four_ranks(env, out):
    """On each of 4 ranks: the FOUR compositions; the GPT on dp=2,tp=2 resumed, its checkpoint offered to zero1;
    --dp-shard zero3 on dp=2,pp=2 refused."""
    from labkit.parallel.mesh import MeshStrategy

    result = _runs(env, FOUR, "gpt dp=2,tp=2", out)
    result["resume"] = _resume(env, "gpt", {"mesh": "dp=2,tp=2"}, {"mesh": "dp=2,tp=2", "dp_shard": "zero1"}, out,
                               result["gpt dp=2,tp=2"]["weights"])
    try:
        MeshStrategy(env, {"mesh": "dp=2,pp=2", "dp_shard": "zero3"}).check_model("gpt-tiny")
    except ConfigError as exc:
        result["zero3"] = str(exc)
    return result


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_two_ranks, 2, str(tmp_path_factory.mktemp("mesh")), timeout=300)


def _runs(env, table, saved=None, out=None):
    """Every composition of ``table``; the one named ``saved`` writes its first epoch's checkpoint into ``out``."""
    return {key: _run(env, kind, options, out if key == saved else None) for key, (kind, options) in table.items()}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks(_four_ranks, 4, str(tmp_path_factory.mktemp("mesh4")), timeout=300)


@pytest.fixture(scope="module")
def eight():
    return run_ranks(_runs, 8, EIGHT, timeout=300)


@pytest.fixture(scope="module")
def single():
    return {(kind, epochs): _single(kind, epochs) for kind in ("cnn", "gpt") for epochs in (EPOCHS, RESUMED_EPOCHS)}


def _check_equal(ranks: list[dict], kind: str, single) -> None:
    """Each data shard has exactly one metric owner per sequence chunk (cp: each rank's loss is its chunks'); the
    mean of the owners' losses every step and every rank's weights (its part of them) equal the oracle's."""
    epochs = ranks[0]["epochs"]
    single_losses, single_weights, names = single[kind, epochs]
    owners = [r for r in ranks if r["owner"]]
    shards, chunks = ranks[0]["data"][0], ranks[0]["sizes"].get("cp", 1)
    counted = sorted((r["data"][1], r["coords"].get("cp", 0)) for r in owners)
    assert counted == [(s, c) for s in range(shards) for c in range(chunks)]  # every token counted once
    losses = torch.stack([torch.stack(r["losses"]) for r in owners]).mean(0)
    assert losses.shape == (epochs * STEPS[kind],)
    torch.testing.assert_close(losses, single_losses, rtol=0, atol=1e-6)
    held = set()
    for r in ranks:
        for name, w in r["weights"].items():
            full = single_weights[name]
            if w.shape != full.shape:  # a tensor-parallel shard: this rank's contiguous slice
                dim = next(i for i, (a, b) in enumerate(zip(w.shape, full.shape, strict=True)) if a != b)
                full = torch.tensor_split(full, r["sizes"]["tp"], dim)[r["coords"]["tp"]]
            torch.testing.assert_close(w, full, rtol=0, atol=1e-5)
            held.add(name)
    assert names <= held  # every weight is on some rank


@pytest.mark.parametrize("key", list(TWO))
def test_two_rank_meshes_equal_one_process(two, single, key):
    _check_equal([r[key] for r in two], TWO[key][0], single)


def test_mesh_checkpoints_resume_bit_identically_and_another_mesh_is_refused(two, four):
    for r in [*two, *four] if FSDP_ON_CPU else four:
        straight, resumed = r["resume"]["straight"], r["resume"]["resumed"]
        assert straight.keys() == resumed.keys()
        assert all(torch.equal(resumed[name], w) for name, w in straight.items())
    for r in two:
        straight, resumed = r["resume zero3"]["straight"], r["resume zero3"]["resumed"]
        assert straight.keys() == resumed.keys()
        assert all(torch.equal(resumed[name], w) for name, w in straight.items())
        assert ": it was written on --mesh dp=2 --dp-shard zero3 but this run has --mesh dp=2 --dp-shard zero1;" \
            in r["resume zero3"]["mismatch"]
        assert not FSDP_ON_CPU or ": it was written on --mesh dp=2 --dp-shard fsdp but this run has --mesh dp=2; " \
               "--dp-shard fsdp does not reshard (a rank holds a shard of each tensor): resume with --mesh dp=2 " \
               "--dp-shard fsdp or start without --resume" in r["resume"]["mismatch"]
    for r in four:  # (another mesh of replicas and tensor-parallel shards reshards: tests/test_sync_reshard.py)
        assert ": it was written on --mesh dp=2,tp=2 but this run has --mesh dp=2,tp=2 --dp-shard zero1; --dp-shard " \
               "zero1 does not reshard (a rank holds a slice of each layer's flat buffer): resume with --mesh " \
               "dp=2,tp=2 or start without --resume" in r["resume"]["mismatch"]


def test_an_allreduce_algorithm_with_a_sharded_dp_is_refused_in_one_line(two):
    assert all(r["ring zero2"] == "--allreduce ring chooses how replicas' gradients are all-reduced, but --dp-shard "
               "zero2 reduce-scatters them; leave --allreduce out or use --dp-shard none" for r in two)


def test_zero3_under_a_pipeline_is_refused_in_one_line(four):
    assert all(r["zero3"] == "--dp-shard zero3 with pp > 1 is not supported: stage 3 gathers each layer's parameters "
               "around its forward and backward, which the pipeline's micro-batches interleave; use --dp-shard zero1 "
               "or zero2, or fsdp" for r in four)


@pytest.mark.parametrize("key", list(FOUR))
def test_four_rank_meshes_equal_one_process(four, single, key):
    _check_equal([r[key] for r in four], FOUR[key][0], single)


def test_dp2_tp2_pp2_on_eight_ranks_equals_one_process(eight, single):
    key = "gpt dp=2,tp=2,pp=2"
    _check_equal([r[key] for r in eight], EIGHT[key][0], single)


def test_padded_evaluation_shards_have_one_length_and_count_each_sample_once():
    from labkit.parallel.mesh import PaddedShardSampler

    shards = [PaddedShardSampler(range(5), 2, r) for r in range(2)]
    assert [list(s) for s in shards] == [[0, 2, 4], [1, 3, 1]]
    assert [(len(s), s.real) for s in shards] == [(3, 3), (3, 2)]
    assert [list(PaddedShardSampler(range(1), 2, r)) for r in range(2)] == [[0], [0]]


def test_the_one_process_note_reads_each_strategy_s_own_literal():
    from labkit.strategies import available
    from labkit.train.run import spread_over_ranks

    assert {n for n in available() if spread_over_ranks(n)} == {"ddp", "fsdp", "hybrid", "tensor-parallel", "zero"}

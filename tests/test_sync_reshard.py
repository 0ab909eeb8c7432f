"""Local SGD and DiLoCo (``--sync local-sgd|diloco --sync-every H``) and checkpoints that reshard, on gloo CPU ranks,
through the same ``labkit.train.loop.fit`` a user runs. One 4-rank spawn:

* an MLP (12 → 8 → 3, P = 12·8 + 8 + 8·3 + 3 = 131 parameters) on ``--mesh dp=4``, plain SGD with momentum 0.9, one
  epoch of 4 steps of 8 samples: DDP (PyTorch's), every-step data parallelism with ``--allreduce native`` (its
  all-reduces visible to Python), local SGD at H = 1, DiLoCo at H = 1 with ``--outer-lr 1 --outer-momentum 0``,
  and local SGD and DiLoCo (the paper's outer lr 0.7, Nesterov 0.9) at H = 2. Every ``torch.distributed`` call made
  inside a ``train_step`` is logged with its element count. DiLoCo at H = 2 is also stopped after step 3 (between
  two meetings), checkpointed and resumed for step 4: bit-identical weights;
* a 2-layer GPT (d = 32, vocabulary 64, T = 16, dropout 0) on ``--mesh dp=2,tp=2``, global batch 8, 4 steps per epoch:
  2 steps, a checkpoint with the mid-epoch position (step 2), and the third step continued in memory; that
  checkpoint resumed on ``dp=4`` and on ``tp=4`` (the third step only), and offered to ``tp=2,pp=2`` (refused).
  The same checkpoint is resumed in this process (one process) and exported to one file (``labkit export``);
* labkit's MLP (16 → 512 → 512 → 3) saved mid-epoch by one process (its nested names, ``linear_relu_stack.fc1``)
  resumed on ``tp=4`` (its flat form, ``fc1``, cut in four) for the next step.

The claims: local SGD at H = 1 with SGD, and DiLoCo at H = 1 with outer SGD lr 1 and no momentum, equal DDP (the
loss of every step within 1e-6, the weights after 4 steps within 1e-6: only the order of the sums differs); the
elements all-reduced per step are counted, 131 every step for every-step data parallelism and local SGD at H = 1,
131 every second step at H = 2 (half the bytes); the next-step loss after a resume on another mesh equals the
uninterrupted run's within 1e-5 (float32 sums in another order over another number of ranks); the export loads
into a plain ``GPT`` with ``load_state_dict`` and holds each rank's shard. Without a spawn: ``labkit sample`` reads
an exported ``gpt-tiny``; uneven tensor-parallel parts join and cut again as ``torch.tensor_split`` cuts; a mid-epoch
resume with another global batch is refused in one line.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from labkit.data.loader import make_loader
from labkit.dist.group import DistEnv
from labkit.dist.testing import record_losses, run_ranks
from labkit.errors import CheckpointError
from labkit.models.gpt import GPT, GPTConfig
from labkit.optim import OptimizerSpec
from labkit.strategies.base import Strategy

BATCH, SEED, LR, STEPS = 8, 3, 0.1, 4
VOCAB, T = 64, 16
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
CONFIG = {"dataset": "tokens", "seq_len": T, "dropout": 0.0}
CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv",
         "isend", "irecv", "all_gather_object", "barrier")
SYNCS = {"ddp": {"mesh": "dp=4"},
         "every-step": {"mesh": "dp=4", "allreduce": "native"},
         "local-sgd H=1": {"mesh": "dp=4", "sync": "local-sgd", "sync_every": 1},
         "diloco H=1 lr 1 m 0": {"mesh": "dp=4", "sync": "diloco", "sync_every": 1, "outer_lr": 1.0,
                                 "outer_momentum": 0.0},
         "local-sgd H=2": {"mesh": "dp=4", "sync": "local-sgd", "sync_every": 2},
         "diloco H=2": {"mesh": "dp=4", "sync": "diloco", "sync_every": 2}}


def _mlp_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(STEPS * BATCH, 12, generator=g), torch.randint(0, 3, (STEPS * BATCH,), generator=g))


def _gpt_data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, T + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _gpt() -> nn.Module:
    torch.manual_seed(2)
    return GPT(GPT_CFG)


def _counted(log: list):
    """Log every torch.distributed call made inside a train_step (one list per step); return the undo."""
    from labkit.train import loop

    originals = {name: getattr(dist, name) for name in CALLS if hasattr(dist, name)}
    step_fn, inside = loop.train_step, [False]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if inside[0]:
                first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
                log[-1].append(f"{name} {0 if first is None else first.numel()}")
            return fn(*args, **kwargs)
        return counted

    def step(*args, **kwargs):
        log.append([])
        inside[0] = True
        try:
            return step_fn(*args, **kwargs)
        finally:
            inside[0] = False

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    loop.train_step = step

    def undo():
        for name, fn in originals.items():
            setattr(dist, name, fn)
        loop.train_step = step_fn
    return undo


def _fit(strategy, model, data, total_steps, task=None, position=None, optimizer=None, scheduler=None):
    from labkit.train.loop import fit
    from labkit.train.tasks import Task

    losses = record_losses(strategy)
    dp = strategy.data_parallel_size
    fit(model, make_loader(data, BATCH // dp, shuffle=True, sampler=strategy.sampler(data, True, SEED), seed=SEED,
                           drop_last=dp > 1), None, optimizer, epochs=1, strategy=strategy, seed=SEED,
        scheduler=scheduler, task=task or Task(), criterion=(task or Task()).criterion(), printer=lambda line: None,
        total_steps=total_steps, position=position)
    return losses


def _built(strategy, model):
    optimizer, _ = strategy.build_optimizer(model, OptimizerSpec("sgd", LR, 0.9))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def _small_mlp(strategy):
    torch.manual_seed(0)
    return strategy.prepare(nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3)))


def _sync_runs(env, out) -> dict:
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.checkpoint import load_training_state, save_training_state
    from labkit.train.loop import epoch_position

    result = {}
    for key, options in SYNCS.items():
        strategy = MeshStrategy(env, options)
        model = _small_mlp(strategy)
        optimizer, scheduler = _built(strategy, model)
        log: list = []
        undo = _counted(log)
        try:
            losses = _fit(strategy, model, _mlp_data(), STEPS, optimizer=optimizer, scheduler=scheduler)
        finally:
            undo()
        weights = {n: p.detach().clone() for n, p in strategy.unwrap(model).named_parameters()}
        result[key] = {"losses": torch.stack(losses), "weights": weights, "calls": log}
    # DiLoCo at H = 2 stopped after step 3, between two meetings, and resumed for step 4 (a meeting: the global
    # parameters and the outer momentum come back from each rank's checkpoint)
    options = SYNCS["diloco H=2"]
    stopped = MeshStrategy(env, options)
    model = _small_mlp(stopped)
    optimizer, scheduler = _built(stopped, model)
    _fit(stopped, model, _mlp_data(), 3, optimizer=optimizer, scheduler=scheduler)
    position = epoch_position(3, torch.zeros(3, dtype=torch.float64), stopped)
    save_training_state(stopped.checkpoint_file(out), stopped, model, optimizer, scheduler, None,
                        {"epoch": 0, "position": position}, {})
    again = MeshStrategy(env, options)
    model = _small_mlp(again)
    optimizer, scheduler = _built(again, model)
    state = load_training_state(again.checkpoint_file(out), again, model, optimizer, scheduler, None)
    _fit(again, model, _mlp_data(), STEPS, position=state["position"], optimizer=optimizer, scheduler=scheduler)
    result["diloco H=2 resumed"] = {n: p.detach().clone() for n, p in again.unwrap(model).named_parameters()}
    return result


def _resumed(env, options, out) -> dict:
    """The third step of the checkpoint in ``out`` resumed on mesh ``options``: its loss (owners only)."""
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.checkpoint import load_training_state
    from labkit.train.tasks import LanguageModelling

    strategy = MeshStrategy(env, options)
    strategy.check_model("gpt", T)
    model = strategy.prepare(_gpt())
    optimizer, scheduler = _built(strategy, model)
    state = load_training_state(strategy.checkpoint_file(out), strategy, model, optimizer, scheduler, None, CONFIG)
    losses = _fit(strategy, model, _gpt_data(), 3, LanguageModelling(), state["position"], optimizer, scheduler)
    return {"loss": losses[-1] if strategy.metric_owner() else None, "steps": len(losses)}


def _reshard_runs(env, out) -> dict:
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.checkpoint import save_training_state
    from labkit.train.loop import epoch_position
    from labkit.train.tasks import LanguageModelling

    strategy = MeshStrategy(env, {"mesh": "dp=2,tp=2"})
    strategy.check_model("gpt", T)
    model = strategy.prepare(_gpt())
    optimizer, scheduler = _built(strategy, model)
    task = LanguageModelling()
    losses = _fit(strategy, model, _gpt_data(), 2, task, None, optimizer, scheduler)
    position = epoch_position(2, torch.zeros(3, dtype=torch.float64), strategy)
    save_training_state(strategy.checkpoint_file(out), strategy, model, optimizer, scheduler, None,
                        {"epoch": 0, "position": position}, CONFIG)
    shards = {n: t.clone() for n, t in strategy.unwrap(model).state_dict().items()}
    tp = next(d for d in strategy.dims if d.name == "tp")
    _fit(strategy, model, _gpt_data(), 3, task, position, optimizer, scheduler)  # `losses` records this step too
    result = {"straight": torch.stack(losses) if strategy.metric_owner() else None, "shards": shards,
              "tp": (tp.rank, tp.size)}
    for options in ({"mesh": "dp=4"}, {"mesh": "tp=4"}):
        result[options["mesh"]] = _resumed(env, options, out)
    try:
        _resumed(env, {"mesh": "tp=2,pp=2", "num_microbatches": 2}, out)
    except CheckpointError as exc:
        result["pp"] = str(exc)
    return result


def _mlp_images():
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(STEPS * BATCH, 1, 4, 4, generator=g), torch.randint(0, 3, (STEPS * BATCH,),
                                                                                       generator=g))


def _labkit_mlp(sequential: bool) -> nn.Module:
    from labkit.models.cnn import get_model

    torch.manual_seed(5)
    return get_model("mlp", num_classes=3, in_channels=1, image_size=4, sequential=sequential)


def _mlp_on_tp4(env, out) -> float | None:
    """The one-process MLP checkpoint in ``out`` (nested names) resumed on tp=4 (the flat form, cut): step 2."""
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.checkpoint import load_training_state

    strategy = MeshStrategy(env, {"mesh": "tp=4"})
    strategy.check_model("mlp")
    model = strategy.prepare(_labkit_mlp(strategy.sequential_model))
    optimizer, scheduler = _built(strategy, model)
    state = load_training_state(strategy.checkpoint_file(out), strategy, model, optimizer, scheduler, None)
    losses = _fit(strategy, model, _mlp_images(), 2, position=state["position"], optimizer=optimizer,
                  scheduler=scheduler)
    return losses[-1] if strategy.metric_owner() else None


def _ranks(env, out):
    return {"sync": _sync_runs(env, os.path.join(out, "diloco")), "reshard": _reshard_runs(env, out),
            "mlp tp=4": _mlp_on_tp4(env, os.path.join(out, "mlp"))}


def test_local_sgd_diloco_and_resharded_checkpoints(tmp_path):
    from labkit.train.checkpoint import save_training_state
    from labkit.train.loop import epoch_position

    # one process, labkit's MLP as labkit train builds it (nested names): step 1, a mid-epoch checkpoint, step 2
    single = Strategy(DistEnv())
    mlp = _labkit_mlp(sequential=False)
    optimizer, scheduler = _built(single, mlp)
    mlp_losses = _fit(single, mlp, _mlp_images(), 1, optimizer=optimizer, scheduler=scheduler)
    position = epoch_position(1, torch.zeros(3, dtype=torch.float64), single)
    (tmp_path / "mlp").mkdir()
    save_training_state(single.checkpoint_file(tmp_path / "mlp"), single, mlp, optimizer, scheduler, None,
                        {"epoch": 0, "position": position}, {})
    _fit(single, mlp, _mlp_images(), 2, position=position, optimizer=optimizer, scheduler=scheduler)

    (tmp_path / "diloco").mkdir()
    ranks = run_ranks(_ranks, 4, str(tmp_path), timeout=300)

    # local SGD at H = 1 with SGD, DiLoCo at H = 1 with outer lr 1 and no momentum: DDP, every step and after 4
    ddp = [r["sync"]["ddp"] for r in ranks]
    for key in ("every-step", "local-sgd H=1", "diloco H=1 lr 1 m 0"):
        for rank, base in zip(ranks, ddp, strict=True):
            torch.testing.assert_close(rank["sync"][key]["losses"], base["losses"], rtol=0, atol=1e-6)
            for name, w in base["weights"].items():
                torch.testing.assert_close(rank["sync"][key]["weights"][name], w, rtol=0, atol=1e-6)
    # counted: elements all-reduced in each of the 4 steps (P = 131); H = 2 sends half
    every = [["all_reduce 131"]] * 4
    assert all(r["sync"]["every-step"]["calls"] == every for r in ranks)
    assert all(r["sync"]["local-sgd H=1"]["calls"] == every for r in ranks)
    assert all(r["sync"]["diloco H=1 lr 1 m 0"]["calls"] == every for r in ranks)
    halved = [[], ["all_reduce 131"], [], ["all_reduce 131"]]
    assert all(r["sync"]["local-sgd H=2"]["calls"] == halved for r in ranks)
    assert all(r["sync"]["diloco H=2"]["calls"] == halved for r in ranks)
    # H = 2: the replicas equal after the last meeting, and not DDP's weights (the loss of drifting apart)
    for r in ranks:
        for key in ("local-sgd H=2", "diloco H=2"):
            assert any(not torch.allclose(r["sync"][key]["weights"][n], ddp[0]["weights"][n], atol=1e-4)
                       for n in ddp[0]["weights"])
            torch.testing.assert_close(r["sync"][key]["weights"], ranks[0]["sync"][key]["weights"], rtol=0, atol=0)
        # stopped between two meetings and resumed on the same mesh: bit-identical
        straight = r["sync"]["diloco H=2"]["weights"]
        assert all(torch.equal(r["sync"]["diloco H=2 resumed"][n], w) for n, w in straight.items())

    # the next-step loss after a resume on another mesh: the uninterrupted dp=2,tp=2 run's third step (the mean over
    # its two dp groups' owners)
    straight = torch.stack([r["reshard"]["straight"] for r in ranks if r["reshard"]["straight"] is not None]).mean(0)
    assert straight.shape == (3,)
    dp4 = torch.stack([r["reshard"]["dp=4"]["loss"] for r in ranks]).mean()
    tp4 = [r["reshard"]["tp=4"]["loss"] for r in ranks if r["reshard"]["tp=4"]["loss"] is not None]
    assert len(tp4) == 1 and all(r["reshard"]["dp=4"]["steps"] == 1 for r in ranks)
    torch.testing.assert_close(dp4, straight[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(tp4[0], straight[2], rtol=0, atol=1e-5)
    assert all(r["reshard"]["pp"] == f"checkpoint in {tmp_path}: it was written on --mesh dp=2,tp=2 but this run has "
               "--mesh pp=2,tp=2 --pp-balance [1, 1]; a pipeline split does not reshard (another split moves the stage boundaries): "
               "resume with --mesh dp=2,tp=2 or start without --resume" for r in ranks), ranks[0]["reshard"]["pp"]

    # the one-process MLP (nested names) on tp=4 (its flat form, cut in 4): the same next step
    tp4_mlp = [r["mlp tp=4"] for r in ranks if r["mlp tp=4"] is not None]
    assert len(mlp_losses) == 2 and len(tp4_mlp) == 1
    torch.testing.assert_close(tp4_mlp[0], mlp_losses[1], rtol=0, atol=1e-5)

    # one process: the same checkpoint, the same next step
    from labkit.train.checkpoint import load_training_state
    from labkit.train.tasks import LanguageModelling

    single = Strategy(DistEnv())
    model = _gpt()
    optimizer, scheduler = _built(single, model)
    state = load_training_state(single.checkpoint_file(tmp_path), single, model, optimizer, scheduler, None, CONFIG)
    losses = _fit(single, model, _gpt_data(), 3, LanguageModelling(), state["position"], optimizer, scheduler)
    torch.testing.assert_close(losses[-1], straight[2], rtol=0, atol=1e-5)

    # labkit export: one file, loaded in plain PyTorch, holding each rank's shard
    from labkit.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "model.pt")]) == 0
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    plain = GPT(GPT_CFG)
    plain.load_state_dict(saved["model"])
    for r in ranks:
        index, parts = r["reshard"]["tp"]
        for name, shard in r["reshard"]["shards"].items():
            whole = saved["model"][name]
            if shard.shape != whole.shape:
                dim = next(i for i, (a, b) in enumerate(zip(shard.shape, whole.shape, strict=True)) if a != b)
                whole = torch.tensor_split(whole, parts, dim)[index]
            assert torch.equal(shard, whole), name


def test_labkit_sample_reads_an_exported_file(tmp_path):
    """A gpt-tiny run's checkpoint (one process), exported: ``labkit sample --out model.pt`` rebuilds the model
    from the file's configuration with the same weights."""
    from labkit.export import export
    from labkit.models.cnn import get_model
    from labkit.sample import load_run
    from labkit.train.checkpoint import save_training_state

    single = Strategy(DistEnv())
    model = get_model("gpt-tiny", num_classes=103, seq_len=T)
    optimizer, scheduler = _built(single, model)
    config = {"model": "gpt-tiny", "dataset": "text-sample", "seq_len": T}
    save_training_state(single.checkpoint_file(tmp_path), single, model, optimizer, scheduler, None, {"epoch": 1},
                        config)
    export(tmp_path, tmp_path / "model.pt")
    loaded, _, cfg = load_run(tmp_path / "model.pt")
    assert cfg == config
    assert all(torch.equal(t, model.state_dict()[name]) for name, t in loaded.state_dict().items())


def test_uneven_parts_join_and_cut_again_as_tensor_split_cuts():
    """Pure: a (5, 3) weight saved in 2 parts of rows (3 + 2, as ``torch.tensor_split`` and the tp layers cut an
    uneven vocabulary), its momentum beside it and a bias kept whole; joined, and cut for 3 parts (2 + 2 + 1)."""
    from labkit.train.reshard import cut, whole_state

    w = torch.arange(15.0).reshape(5, 3)
    states = [{"layout": {"w": [0, r, 2, [5, 3]]}, "param_names": ["w", "b"],
               "model": {"w": w[rows], "b": torch.ones(3)},
               "optimizer": {"state": {0: {"momentum_buffer": -w[rows], "step": torch.tensor(7.0)}, 1: {}}}}
              for r, rows in enumerate((slice(0, 3), slice(3, 5)))]
    model, optimizer = whole_state(states)
    assert torch.equal(model["w"], w) and torch.equal(model["b"], torch.ones(3))
    assert torch.equal(optimizer["w"]["momentum_buffer"], -w) and optimizer["w"]["step"].item() == 7.0
    assert [cut(model["w"], [0, r, 3, [5, 3]]).tolist() for r in range(3)] == [
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]], [[12.0, 13.0, 14.0]]]


def test_a_mid_epoch_resume_with_another_global_batch_is_refused_in_one_line():
    """Pure: a position counts steps of the writer's global batch (``--batch-size`` is per data-parallel rank)."""
    from labkit.train.checkpoint import _check_same_batch

    state = {"config": {"batch_size": 16}, "data_parallel_size": 2, "epoch": 0, "position": {"step": 3}}
    with pytest.raises(CheckpointError) as refused:
        _check_same_batch(state, {"batch_size": 16}, 1)
    assert str(refused.value) == ("it stopped in epoch 1 after step 3 of global batches of 32 samples, and this run's "
                                  "global batch is 16 (16 per rank × 1); resume with --batch-size 32 so that the step "
                                  "holds the same samples")
    _check_same_batch(state, {"batch_size": 8}, 4)  # 8 × 4 = 32: the same samples


def test_export_without_a_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    from labkit.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "model.pt")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"labkit: error: {tmp_path}: no checkpoint there (checkpoint.pt or checkpoint.rank*.pt); train with labkit "
        "train --out RUN (checkpoints are on by default)"]

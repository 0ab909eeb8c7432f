"""Resume places the model before its state is loaded (and the GPU random states fit the node), checked on CPU.

On a GPU a layer moved after ``optimizer.load_state_dict`` leaves its momentum (and K-FAC's factors) on the old
device, and the first step fails. Without a GPU the same mistake is visible as a module move (``nn.Module._apply``,
what ``.to(device)`` runs) after the load: every strategy's resume must make none.
"""
import pytest
import torch
from torch import nn

from labkit.dist.testing import run_ranks
from labkit.train import run as train_run
from labkit.train.config import TrainConfig
from labkit.train.rng import cuda_rng_states, restore_cuda_rng
from labkit.train.run import run

TINY = dict(model="mlp", dataset="synthetic-mnist", train_size=64, test_size=32, batch_size=16, max_steps=2,
            device="cpu", log_every=100)


@pytest.mark.parametrize("strategy, options, optimizer", [
    ("single", {}, "kfac"),
    ("gpipe", {"partitions": 2, "balance_by": "time", "num_microbatches": 2}, "kfac"),
    ("gpipe", {"balance": [2, 4], "num_microbatches": 2}, "sgd"),
    ("model-parallel", {"mp_devices": 2, "mp_balance_by": "time"}, "kfac"),
    ("model-parallel", {"mp_devices": 2, "mp_balance_by": "params"}, "sgd"),
])
def test_resume_moves_no_layer_after_the_state_is_loaded(strategy, options, optimizer, tmp_path, monkeypatch):
    """K-FAC on LeNet: its factors are at most 401 wide (the mlp's 785 made K-FAC's runs eight times dearer)."""
    cfg = dict(TINY, model="lenet" if optimizer == "kfac" else "mlp", strategy=strategy, optimizer=optimizer,
               out=str(tmp_path))
    run(TrainConfig(**cfg, epochs=1, strategy_options=dict(options)))

    loaded, moved = [], []
    load = train_run.load_training_state

    def load_then_mark(*args, **kwargs):
        state = load(*args, **kwargs)
        loaded.append(state)
        return state

    apply = nn.Module._apply

    def record_moves(module, fn, *args, **kwargs):
        if loaded:
            moved.append(type(module).__name__)
        return apply(module, fn, *args, **kwargs)

    monkeypatch.setattr(train_run, "load_training_state", load_then_mark)
    monkeypatch.setattr(nn.Module, "_apply", record_moves)
    summary = run(TrainConfig(**cfg, epochs=2, resume=True, strategy_options=dict(options)))
    assert len(loaded) == 1 and loaded[0]["epoch"] == 1
    assert moved == []
    assert summary["metrics"]["epochs_run"] == 2  # the first attempt's epoch and the resumed one's
    if optimizer == "kfac" and strategy != "single":  # balanced by time: the profiler must not feed K-FAC either
        monkeypatch.undo()
        run(TrainConfig(**dict(cfg, out=str(tmp_path / "whole")), epochs=2, strategy_options=dict(options)))
        resumed, whole = (torch.load(p / "checkpoint.pt", weights_only=True)["model"]
                          for p in (tmp_path, tmp_path / "whole"))
        for k in whole:
            torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=0)


def test_a_lazily_partitioned_checkpoint_without_its_balance_is_one_clear_error(tmp_path):
    from labkit.dist.group import DistEnv
    from labkit.errors import CheckpointError
    from labkit.models.cnn import get_model
    from labkit.strategies.gpipe import GPipeStrategy
    from labkit.strategies.model_parallel import ModelParallelStrategy

    for strategy in (GPipeStrategy(DistEnv(), {"partitions": 2}), ModelParallelStrategy(DistEnv(), {"mp_balance_by": "time"})):
        model = strategy.prepare(get_model("mlp", sequential=True))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": strategy.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}
        with pytest.raises(CheckpointError, match="no balance.*start without --resume"):
            strategy.load_state_dict(model, optimizer, state)


# ----- GPU random states: this rank's devices, restored where the node sees them ----------------------------------

@pytest.fixture
def fake_gpus(monkeypatch):
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: torch.tensor([10 + torch.device(d).index]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, index: restored.__setitem__(index, int(state)))
    return restored


def test_a_rank_saves_its_own_gpus_states_by_index(fake_gpus):
    assert cuda_rng_states([torch.device("cpu")]) == {}
    states = cuda_rng_states([torch.device("cuda", 1)])
    assert list(states) == [1] and int(states[1]) == 11
    pipeline = cuda_rng_states([torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1)])
    assert {i: int(s) for i, s in pipeline.items()} == {0: 10, 1: 11}


def test_resume_restores_the_states_this_node_sees_and_says_which_it_cannot(fake_gpus, monkeypatch):
    saved = {0: torch.tensor([5]), 1: torch.tensor([6]), 3: torch.tensor([8])}
    assert restore_cuda_rng(saved) == [3]  # this node sees 2 GPUs: no IndexError for the fourth
    assert fake_gpus == {0: 5, 1: 6}
    assert restore_cuda_rng([torch.tensor([7])]) == [] and fake_gpus[0] == 7  # the older list format
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU node: nothing to restore, no CUDA call
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("CUDA queried on a CPU node"))
    assert restore_cuda_rng({0: torch.tensor([1])}) == [0]


MULTI_RANK = {"ddp": {}, "zero": {"zero_stage": 3}, "fsdp": {}, "tensor-parallel": {}, "pipeline": {},
              "ps": {"ps_mode": "sync"}}


def _resume_every_multi_rank_strategy(env, root):
    """In the group run_ranks started: each strategy trains an epoch, then resumes with module moves recorded."""
    import contextlib

    from labkit.dist.group import seed_everything

    def same_group(*args, seed=0, **kwargs):
        seed_everything(seed)
        return contextlib.nullcontext(env)

    train_run.distributed = same_group
    moves = {}
    for strategy, options in MULTI_RANK.items():
        cfg = dict(TINY, strategy=strategy, out=f"{root}/{strategy}")
        run(TrainConfig(**cfg, epochs=1, strategy_options=dict(options)))
        load, apply, moved = train_run.load_training_state, nn.Module._apply, []
        train_run.load_training_state = lambda *a, **k: (moved.append("loaded"), load(*a, **k))[1]
        nn.Module._apply = lambda m, fn, *a, **k: (moved.append(type(m).__name__), apply(m, fn, *a, **k))[1]
        try:
            run(TrainConfig(**cfg, epochs=2, resume=True, strategy_options=dict(options)))
        finally:
            train_run.load_training_state, nn.Module._apply = load, apply
        moves[strategy] = moved[moved.index("loaded"):] if "loaded" in moved else moved
    return moves


def test_every_multi_rank_strategy_resumes_without_moving_a_layer(tmp_path):
    for moves in run_ranks(_resume_every_multi_rank_strategy, 2, str(tmp_path), timeout=300):
        assert moves == {strategy: ["loaded"] for strategy in MULTI_RANK}

"""Multi-process pipeline schedules (labkit.parallel.pipelining) and their charts (labkit.viz.pipeline).

One spawn of 3 gloo ranks checks GPipe and 1F1B against single-process training: gradients, loss, outputs,
the training loop with a smaller last batch and evaluation, and the recorded order of every forward and
backward (the schedules, as literal data). The rest needs no process group.
"""
import copy

import matplotlib
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.parallel.pipeline_stages import even_balance, microbatches_for, stage_layers
from labkit.parallel.pipelining import PipelineStrategy
from labkit.train.loop import fit
from labkit.viz import pipeline as viz

matplotlib.use("Agg")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))


def _on_rank(env):
    """Per schedule: this stage's gradients and the full model's, after 2 steps; then 1F1B through fit()."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 5, (8,))
    criterion = nn.CrossEntropyLoss()
    result = {}
    for schedule in ("gpipe", "1f1b"):
        full = mlp()
        reference = copy.deepcopy(full)
        strategy = PipelineStrategy(env, {"schedule": schedule, "num_microbatches": 4, "trace_steps": 1})
        stage = strategy.prepare(full)
        for _ in range(2):
            stage.zero_grad(set_to_none=True)
            loss, out = strategy.forward_backward(stage, x, y, criterion)
        ref_out = reference(x)
        ref_loss = criterion(ref_out, y)
        ref_loss.backward()
        mine = stage_layers(reference, strategy.balance, env.rank)
        result[schedule] = {"grads": [p.grad for p in stage.parameters()], "ref": [p.grad for p in mine.parameters()],
                            "loss": loss, "out": out, "ref_loss": ref_loss.detach(), "ref_out": ref_out.detach(),
                            "trace": strategy.trace()}
    data = TensorDataset(torch.randn(22, 1, 6, 6), torch.randint(0, 5, (22,)))  # batches of 8, 8 and 6
    loader = DataLoader(data, batch_size=8)
    full = mlp()
    reference = copy.deepcopy(full)
    strategy = PipelineStrategy(env, {"schedule": "1f1b", "num_microbatches": 4})
    stage = strategy.prepare(full)
    quiet = {"epochs": 1, "printer": lambda line: None}
    history = fit(stage, loader, loader, torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9),
                  strategy=strategy, **quiet)
    ref_history = fit(reference, loader, loader, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
                      **quiet)
    mine = stage_layers(reference, strategy.balance, env.rank)
    result["fit"] = {"params": [p.detach() for p in stage.parameters()],
                     "ref": [p.detach() for p in mine.parameters()], "history": history, "ref_history": ref_history}
    return result


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_on_rank, 3, timeout=300)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_gives_single_process_gradients(ranks, schedule):
    for rank in ranks:
        got = rank[schedule]
        for g, r in zip(got["grads"], got["ref"]):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)  # float32, micro-batch sums reordered
    last = ranks[-1][schedule]
    torch.testing.assert_close(last["loss"], last["ref_loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(last["out"], last["ref_out"], atol=1e-6, rtol=1e-5)
    assert ranks[0][schedule]["loss"] is None and ranks[1][schedule]["out"] is None  # only the last owns them


def test_training_loop_with_a_smaller_last_batch_matches_single_process(ranks):
    for rank in ranks:
        for p, r in zip(rank["fit"]["params"], rank["fit"]["ref"]):
            torch.testing.assert_close(p, r, atol=1e-5, rtol=1e-4)  # 3 SGD steps amplify rounding a little
        got, ref = rank["fit"]["history"][0], rank["fit"]["ref_history"][0]
        for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
            assert got[key] == pytest.approx(ref[key], abs=1e-5)


EXPECTED_ORDER = {  # 3 stages, 4 micro-batches, per rank
    "gpipe": {r: ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"] for r in range(3)},
    "1f1b": {0: ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],
             1: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
             2: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]},
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recorded_timeline_follows_the_schedule(ranks, schedule):
    trace = ranks[0][schedule]["trace"]
    assert ranks[1][schedule]["trace"] is None and trace["steps"] == [1]
    for rank, expected in EXPECTED_ORDER[schedule].items():
        events = sorted((e for e in trace["events"] if e["rank"] == rank and e["kind"] in "FB"),
                        key=lambda e: e["start"])
        assert [f"{e['kind']}{e['mb']}" for e in events] == expected
        assert all(e["end"] >= e["start"] for e in events)
    assert trace["comm_recorded"] and any(e["kind"] == "wait" for e in trace["events"])
    bubble = viz.bubble_fraction(trace)
    assert bubble["theoretical"] == pytest.approx(2 / 6) and 0 < bubble["measured"] < 1
    assert ideal_order(schedule) == EXPECTED_ORDER[schedule]


def ideal_order(schedule):
    trace = viz.ideal_trace(3, 4, schedule)
    return {r: [f"{e['kind'][0]}{e['mb']}" for e in sorted(trace["events"], key=lambda e: e["start"]) if e["rank"] == r]
            for r in range(3)}


def test_1f1b_keeps_fewer_activations_than_gpipe_and_the_charts_draw(ranks):
    gpipe, one_f_one_b = ranks[0]["gpipe"]["trace"], ranks[0]["1f1b"]["trace"]
    peaks = viz.peak_memory(gpipe), viz.peak_memory(one_f_one_b)
    assert peaks[1][0] < peaks[0][0]  # stage 0 holds 3 micro-batches under 1F1B, all 4 under GPipe
    fig = viz.compare_schedules({"GPipe": gpipe, "1F1B": one_f_one_b})
    assert "bubble measured" in fig.axes[0].get_title() and len(fig.axes) >= 3


def test_bubble_fraction_of_a_literal_trace():
    events = [{"rank": 0, "step": 1, "kind": "F", "mb": 0, "start": 0.0, "end": 1.0},
              {"rank": 0, "step": 1, "kind": "B", "mb": 0, "start": 3.0, "end": 4.0},
              {"rank": 1, "step": 1, "kind": "wait", "mb": None, "start": 0.0, "end": 1.0},
              {"rank": 1, "step": 1, "kind": "F", "mb": 0, "start": 1.0, "end": 2.0},
              {"rank": 1, "step": 1, "kind": "B", "mb": 0, "start": 2.0, "end": 3.0}]
    bubble = viz.bubble_fraction({"events": events})
    assert bubble["per_rank"] == {0: 0.5, 1: 0.5} and bubble["span_s"] == 4.0
    assert bubble["wait_s"] == {0: 0, 1: 1.0} and bubble["theoretical"] == pytest.approx(1 / 2)


def test_even_balance_and_micro_batches_for_a_smaller_batch():
    assert even_balance(7, 3) == [3, 2, 2] and even_balance(6, 2) == [3, 3]
    assert microbatches_for(8, 4) == 4 and microbatches_for(6, 4, minimum=3) == 3
    assert microbatches_for(5, 4, minimum=3) is None and microbatches_for(5, 4) == 1


@pytest.mark.parametrize("env, options, message", [
    (DistEnv(), {}, "needs >= 2 ranks"),
    (DistEnv(world_size=3), {"schedule": "1f1b", "num_microbatches": 2},
     "--schedule 1f1b needs --num-microbatches >= the number of stages (3), got 2"),
    (DistEnv(world_size=2), {"schedule": "zigzag"}, "--schedule 'zigzag'"),
])
def test_bad_pipeline_options_are_clear_errors(env, options, message):
    with pytest.raises(ConfigError) as err:
        PipelineStrategy(env, options)
    assert message in str(err.value)


class NotSequential(nn.Module):
    """A model that is not an ``nn.Sequential`` (the pipeline refuses it)."""

    def forward(self, x):
        return x


@pytest.mark.parametrize("model, options, message", [
    (NotSequential(), {}, "got NotSequential"),
    (mlp(), {"balance": [2, 2]}, "--balance 2 2 sums to 4 but the model has 6 layers"),
    (mlp(), {"balance": [6]}, "--balance 6 gives 1 stage(s) but there are 2 ranks"),
    (mlp(), {"balance": [2, 2, 2]}, "--balance 2 2 2 gives 3 stage(s) but there are 2 ranks"),
])
def test_bad_model_or_balance_is_a_clear_error(model, options, message):
    with pytest.raises(ConfigError) as err:
        PipelineStrategy(DistEnv(world_size=2), options).prepare(model)
    assert message in str(err.value)


@pytest.mark.parametrize("batch, message", [
    (2, "--num-microbatches 4 is larger than the batch (2 samples)"),
    (6, "batch of 6 samples does not split into 4 equal micro-batches"),
])
def test_batch_that_does_not_split_is_a_clear_error(batch, message):
    strategy = PipelineStrategy(DistEnv(world_size=2), {"num_microbatches": 4})
    with pytest.raises(ConfigError) as err:  # what labkit train asks before the data, the model and its banner
        strategy.check_batch(batch)
    assert message in str(err.value)
    strategy.check_batch(8)
    stage = strategy.prepare(mlp())
    with pytest.raises(ConfigError) as err:
        strategy.forward_backward(stage, torch.randn(batch, 1, 6, 6), torch.zeros(batch, dtype=torch.long),
                                  nn.CrossEntropyLoss())
    assert message in str(err.value)

"""GPipe in one process (labkit.strategies.gpipe): the pipelined model computes what the unpartitioned one
does, for every micro-batch count and checkpoint mode; balancing; bad input -> a clear ConfigError."""
import copy
import threading

import pytest
import torch
import torchgpipe.pipeline
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchgpipe import GPipe
from torchgpipe.worker import spawn_workers

from labkit.cli import main as cli
from labkit.dist.group import DistEnv
from labkit.errors import ConfigError
from labkit.strategies.balance import SavedActivations, compute_balance, estimate_layer_memory
from labkit.strategies.gpipe import GPipeStrategy, make_gpipe
from labkit.train.loop import fit

CPU2 = ["cpu", "cpu"]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_gpipe_equals_unpartitioned_model(chunks, checkpoint):
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 5, (8,))
    pipe = make_gpipe(model, CPU2, chunks=chunks, checkpoint=checkpoint, balance=[3, 3])
    out = pipe(x)
    nn.functional.cross_entropy(out, y).backward()
    ref_out = reference(x)
    nn.functional.cross_entropy(ref_out, y).backward()
    # float32; only the order of the gradient sums over micro-batches differs
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    for g, r in zip(grads(model), grads(reference)):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_gpipe_with_batchnorm_equals_the_model_run_per_micro_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 1, 4, 4)
    pipe = make_gpipe(model, CPU2, chunks=2, checkpoint="always", balance=[2, 3])
    pipe(x).square().mean().backward()
    # BatchNorm normalises over each micro-batch, so the reference runs the same micro-batches
    torch.cat([reference(c) for c in x.chunk(2)]).square().mean().backward()
    for g, r in zip(grads(model), grads(reference)):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_strategy_trains_like_a_single_device():
    model = mlp()
    reference = copy.deepcopy(model)
    data = TensorDataset(torch.randn(24, 1, 6, 6), torch.randint(0, 5, (24,)))
    loader = DataLoader(data, batch_size=8)
    strategy = GPipeStrategy(DistEnv(), {"num_microbatches": 4, "balance_by": "memory", "checkpoint_mode": "always"})
    pipe = strategy.prepare(model)
    fit(pipe, loader, None, torch.optim.SGD(strategy.unwrap(pipe).parameters(), lr=0.1, momentum=0.9), epochs=1,
        strategy=strategy, printer=lambda line: None)
    fit(reference, loader, None, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), epochs=1,
        printer=lambda line: None)
    assert sum(strategy.balance) == len(model) and len(strategy.balance) == 2
    assert strategy.unwrap(pipe) is model and (strategy.input_device, strategy.target_device) == (torch.device("cpu"),) * 2
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)


def test_memory_estimate_is_parameters_times_scale_plus_saved_activations():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    sizes = estimate_layer_memory(model, torch.randn(5, 8), param_scale=2.0)
    linear = 2 * (8 * 16 + 16) * 4 + 5 * 8 * 4  # weights + grads, and the input saved for the weight gradient
    relu = 5 * 16 * 4                           # ReLU saves its output
    assert sizes == [linear, relu]


def test_saved_activations_meter_sees_checkpointing_lower_the_peak():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])
    x = torch.randn(16, 32, requires_grad=True)
    with SavedActivations(exclude=model.parameters()) as plain:
        model(x).sum().backward()
    with SavedActivations(exclude=model.parameters()) as recomputed:
        torch.utils.checkpoint.checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()
    assert plain.live_bytes == 0 and recomputed.live_bytes == 0
    # x and the 8 Tanh outputs (each also the next Linear's saved input, counted once), all alive at once
    assert plain.peak_bytes == 9 * 16 * 32 * 4
    assert recomputed.peak_bytes < plain.peak_bytes


@pytest.mark.parametrize("method", ["time", "memory"])
def test_measured_balance_covers_every_layer(method):
    model = mlp()
    balance = compute_balance(method, 3, model, torch.randn(8, 1, 6, 6), 2, torch.device("cpu"), 0.01)
    assert len(balance) == 3 and sum(balance) == len(model) and min(balance) >= 1


class NotSequential(nn.Module):
    """A model that is not an ``nn.Sequential`` (GPipe refuses it)."""

    def forward(self, x):
        return x


@pytest.mark.parametrize("kwargs, message", [
    ({"model": NotSequential()}, "pipelining cuts an nn.Sequential into partitions, got NotSequential"),
    ({"balance": [2, 3]}, "--balance 2 3 sums to 5 but the model has 6 layers"),
    ({"balance": [2, 2, 2]}, "3 partitions but only 2 device(s)"),
    ({"chunks": 9}, "--num-microbatches 9 is larger than the batch (8 samples)"),
    ({"checkpoint": "sometimes"}, "--checkpoint-mode 'sometimes'"),
])
def test_bad_gpipe_configuration_is_a_clear_error(kwargs, message):
    args = {"model": mlp(), "devices": CPU2, "chunks": 2, "balance": [3, 3], "sample": torch.randn(8, 1, 6, 6)} | kwargs
    with pytest.raises(ConfigError) as err:
        make_gpipe(**args)
    assert message in str(err.value)


def test_strategy_rejects_a_batch_smaller_than_the_micro_batch_count_and_several_ranks():
    strategy = GPipeStrategy(DistEnv(), {"num_microbatches": 8, "balance": [3, 3]})
    pipe = strategy.prepare(mlp())
    with pytest.raises(ConfigError, match="--num-microbatches 8 is larger than the batch \\(4 samples\\)"):
        strategy.forward_backward(pipe, torch.randn(4, 1, 6, 6), torch.zeros(4, dtype=torch.long),
                                  nn.CrossEntropyLoss())
    with pytest.raises(ConfigError, match="runs in one process"):
        GPipeStrategy(DistEnv(world_size=2), {})


def test_labkit_train_gpipe_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(["train", "--strategy", "gpipe", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size",
                "64", "--test-size", "32", "--batch-size", "16", "--num-microbatches", "4", "--balance-by", "memory",
                "--checkpoint-mode", "always", "--max-steps", "3", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gpipe | balance [" in printed and "(by memory) on cpu, cpu | 4 micro-batches" in printed
    assert "samples/sec" in printed and "CPU (process, all devices)" in printed
    assert (out / "summary.json").exists()


def test_labkit_train_gpipe_bad_balance_is_one_line_exit_2(tmp_path, capsys):
    assert cli(["train", "--strategy", "gpipe", "--model", "mlp", "--dataset", "synthetic-mnist", "--balance", "1",
                "1", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--balance 1 1 sums to 2 but the model has 6 layers" in err[0]


def on_threads(model: nn.Sequential) -> set:
    """The threads ``model``'s second layer runs its forward on, filled in as it runs."""
    threads = set()
    model[1].register_forward_hook(lambda *_: threads.add(threading.get_ident()))
    return threads


def test_labkits_cpu_tasks_run_on_the_calling_thread_and_equal_a_plain_torchgpipe_after_it():
    """labkit's pipeline runs its tasks inline (no thread started per mini-batch); a plain torchgpipe.GPipe
    trained right after it in the same process runs on torchgpipe's worker threads, and the two end
    bit-identical, for every checkpoint mode, over a few optimizer steps."""
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 5, (8,))
    for checkpoint in ["always", "except_last", "never"]:
        runs, threads = {}, {}
        for kind in ["labkit", "torchgpipe"]:  # labkit's first: the plain one must not inherit its execution
            model = mlp()
            seen, threads[kind] = on_threads(model), set()
            pipe = (make_gpipe(model, CPU2, chunks=4, checkpoint=checkpoint, balance=[3, 3]) if kind == "labkit"
                    else GPipe(model, [3, 3], devices=CPU2, chunks=4, checkpoint=checkpoint))
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for _ in range(3):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(pipe(x), y)
                threads[kind] |= seen  # the forward's threads (backward recomputes on the calling thread)
                loss.backward()
                seen.clear()
                opt.step()
            runs[kind] = [p.detach().clone() for p in model.parameters()]
        assert threads["labkit"] == {threading.get_ident()}, checkpoint
        assert threads["torchgpipe"] and threading.get_ident() not in threads["torchgpipe"], checkpoint
        for a, b in zip(runs["labkit"], runs["torchgpipe"]):
            assert torch.equal(a, b), checkpoint
    assert torchgpipe.pipeline.spawn_workers is spawn_workers


def test_torchgpipe_is_its_own_outside_labkits_forward_autocast_and_other_threads_included():
    """Autocast is per thread: labkit's inline pipeline computes in the caller's bfloat16, a plain GPipe's
    worker threads in float32, before and after labkit's ran. While a labkit forward is open on one thread,
    a plain GPipe run by another thread still gets torchgpipe's workers."""
    from labkit.strategies import gpipe_workers

    x = torch.randn(4, 1, 6, 6)
    labkit = make_gpipe(mlp(), CPU2, chunks=2, checkpoint="never", balance=[3, 3])
    plain_model = mlp()
    plain = GPipe(plain_model, [3, 3], devices=CPU2, chunks=2)
    with torch.autocast("cpu", torch.bfloat16):
        dtypes = [plain(x).dtype, labkit(x).dtype, plain(x).dtype]
    assert dtypes == [torch.float32, torch.bfloat16, torch.float32]
    assert torchgpipe.pipeline.spawn_workers is spawn_workers

    threads, caller = on_threads(plain_model), []

    def run_plain():
        caller.append(threading.get_ident())
        plain(x)

    with gpipe_workers.inline_tasks():
        other = threading.Thread(target=run_plain)
        other.start()
        other.join()
    assert len(threads) == 1 and threads.isdisjoint({threading.get_ident(), *caller})
    assert torchgpipe.pipeline.spawn_workers is spawn_workers


def test_an_error_inside_a_partition_surfaces_and_the_pipeline_still_works_after_it():
    model = mlp()
    pipe = make_gpipe(model, CPU2, chunks=2, checkpoint="never", balance=[3, 3])
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        pipe(torch.randn(4, 1, 5, 5))  # 25 features where the Linear takes 36
    assert torchgpipe.pipeline.spawn_workers is spawn_workers  # put back on the way out of the error too
    reference = copy.deepcopy(mlp())
    x = torch.randn(4, 1, 6, 6)
    torch.testing.assert_close(pipe(x), reference(x), atol=1e-6, rtol=1e-5)


def test_a_pipeline_with_a_gpu_or_outside_labkits_forward_keeps_torchgpipes_worker_threads(monkeypatch):
    from contextlib import contextmanager

    from labkit.strategies import gpipe_workers

    seen = []

    @contextmanager
    def threads(devices):
        seen.append(list(devices))
        yield "queues"

    monkeypatch.setattr(gpipe_workers, "spawn_workers", threads)
    gpu = [torch.device("cpu"), torch.device("cuda", 0)]
    with gpipe_workers._workers(CPU2) as queues:
        assert queues == "queues"
    with gpipe_workers.inline_tasks():
        with gpipe_workers._workers(CPU2) as (ins, outs):
            assert all(isinstance(q, gpipe_workers.InlineWorker) for q in ins + outs)
        with gpipe_workers._workers(gpu) as queues:
            assert queues == "queues"
    assert seen == [CPU2, gpu]

"""Sharded data parallelism: ZeRO stages 1-3 (from scratch) and FSDP2 train exactly like DDP and like one process
on the global batch, send the bytes and hold the memory the formulas say, resume bit-identically from per-rank
shards, and refuse bad input clearly."""
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labkit.cli import main
from labkit.dist.testing import run_ranks
from labkit.errors import CheckpointError
from labkit.optim import OptimizerSpec
from labkit.parallel.dp import fsdp_refusal
from labkit.strategies import get_strategy
from labkit.train.checkpoint import load_training_state, save_training_state
from labkit.train.loop import fit

B, SAMPLES, LR = 4, 48, 0.1
TINY = 1e-4  # --bucket-mb 0.0001 (104 bytes): each Linear a bucket of its own; the default 25 MB: one bucket
#: FSDP2 runs on CPU ranks from torch 2.7 on (labkit refuses it before, labkit.parallel.dp.fsdp_refusal): its runs
#: are left out on an older torch
FSDP_ON_CPU = fsdp_refusal("--strategy fsdp", "cpu") is None
SHARDED = [("zero", {"zero_stage": 1}), ("zero", {"zero_stage": 2}), ("zero", {"zero_stage": 3}),
           ("zero", {"zero_stage": 1, "bucket_mb": TINY}), ("zero", {"zero_stage": 2, "bucket_mb": TINY}),
           ("zero", {"zero_stage": 3, "zero_prefetch": True, "bucket_mb": TINY}),
           *([("fsdp", {})] if FSDP_ON_CPU else [])]


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g))


def _model():
    torch.manual_seed(1)  # Linear(6, 5): 35 parameters, Linear(5, 3): 18 -> Ψ = 53, uneven over 2 and 3 ranks
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _setup(env, name, options, optimizer):
    strategy = get_strategy(name)(env, options)
    model = strategy.prepare(_model())
    opt, _ = strategy.build_optimizer(model, OptimizerSpec(optimizer, LR, 0.9, 0.01, {}, env))
    data = _data()
    loader = DataLoader(data, batch_size=B, sampler=strategy.sampler(data, True, 0))
    return strategy, model, opt, loader


def _full(strategy, model):
    if strategy.name == "zero":
        return strategy.full_parameters()
    if strategy.name == "fsdp":
        return strategy.full_parameters(model)
    return [p.detach().clone() for p in strategy.unwrap(model).parameters()]


def _train_all(env, steps, tmp=None):
    """Every strategy × optimizer through `fit` for `steps` steps; bytes sent per step and memory held;
    with ``tmp``, also the resume check (one spawn checks it all)."""
    from labkit.lab.sharding import collective_costs

    out = {"params": {}, "bytes": {}, "memory": {}, "calls": {}, "costs": collective_costs(54, env.device, repeats=2),
           "resume": _resume(env, tmp, "zero", {"zero_stage": 3}) if tmp else None,
           "resume_fsdp": _resume(env, tmp / "fsdp", "fsdp", {}) if tmp and FSDP_ON_CPU else None}
    for optimizer in ("sgd", "adam"):
        for name, options in [("ddp", {"allreduce": "native"}), *SHARDED]:
            strategy, model, opt, loader = _setup(env, name, options, optimizer)
            before, calls = (strategy.comm.sent_bytes, strategy.comm.calls) if name == "zero" else (0, 0)
            fit(model, loader, None, opt, epochs=1, strategy=strategy, max_steps=steps, printer=lambda s: None)
            key = (optimizer, name, options.get("zero_stage"), options.get("bucket_mb"), options.get("zero_prefetch"))
            if name == "zero":
                out["bytes"][key] = (strategy.comm.sent_bytes - before) / steps
                out["calls"][key] = (strategy.comm.calls - calls) / steps
                out["memory"][key] = strategy.memory_bytes(opt)
            elif name == "fsdp":
                out["memory"][key] = strategy.memory_bytes(model, opt)
            out["params"][key] = _full(strategy, model)
    return out


def _single_process(world, steps, optimizer):
    """The same global batches (the union of the ranks' shards) in one process, through `fit`."""
    data = _data()
    shards = [list(DistributedSampler(data, world, r, shuffle=True, seed=0, drop_last=True)) for r in range(world)]
    batches = [sum((s[t * B:(t + 1) * B] for s in shards), []) for t in range(steps)]
    model = _model()
    opt = (torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.01) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.01))
    fit(model, DataLoader(data, batch_sampler=batches), None, opt, epochs=1, printer=lambda s: None)
    return [p.detach() for p in model.parameters()]


# (world, memory per rank in bytes: params, grads, optimizer state for SGD+momentum; Adam doubles the state)
# Buckets padded to multiples of N: one bucket of 53 -> 54 floats over N = 2 (27 per rank) and N = 3 (18 per rank);
# two (TINY) of 35 + 18 -> 36 + 18 = 54 for both N as well.
MEMORY = {2: {1: (216, 216, 108), 2: (216, 108, 108), 3: (108, 108, 108)},
          3: {1: (216, 216, 72), 2: (216, 72, 72), 3: (72, 72, 72)}}
# bytes each rank sends per step: an all-reduce of 54 floats on a ring is 2(N-1)/N · 216 B
ALLREDUCE_BYTES = {2: 216, 3: 288}


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_strategies_equal_ddp_and_one_process_with_the_formulas_bytes_and_memory(world, tmp_path):
    steps = 4  # 48 samples: 6 steps per epoch on 2 ranks, 4 on 3
    ranks = run_ranks(_train_all, world, steps, tmp_path if world == 2 else None, timeout=300)
    for optimizer in ("sgd", "adam"):
        single = _single_process(world, steps, optimizer)
        for rank in ranks:
            params = {k: v for k, v in rank["params"].items() if k[0] == optimizer}
            ddp = params.pop((optimizer, "ddp", None, None, None))
            for p, q in zip(ddp, single, strict=True):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
            for key, ps in params.items():
                for p, q in zip(ps, ddp, strict=True):  # float32: the reduction order may differ (N = 3)
                    torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=str(key))
    for rank in ranks:
        for (optimizer, name, stage, bucket_mb, prefetch), sent in rank["bytes"].items():
            assert sent == ALLREDUCE_BYTES[world] * (1.5 if stage == 3 else 1), (optimizer, stage, prefetch)
        for (optimizer, name, stage, bucket_mb, prefetch), calls in rank["calls"].items():
            # per step and bucket a reduce-scatter and an all-gather (stage 3: two); 1 bucket, or 2 when tiny
            assert calls == (3 if stage == 3 else 2) * (2 if bucket_mb == TINY else 1), (optimizer, stage, bucket_mb)
        for (optimizer, name, stage, bucket_mb, prefetch), held in rank["memory"].items():
            if name != "zero":
                continue
            params, grads, state = MEMORY[world][stage]
            assert held == {"params": params, "grads": grads, "optimizer": state * (2 if optimizer == "adam" else 1)}
    # the collective costs the bench prints: each of the three timed, the slowest rank's, the same on every rank
    assert set(ranks[0]["costs"]) == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(t > 0 for t in ranks[0]["costs"].values()) and all(r["costs"] == ranks[0]["costs"] for r in ranks)
    # FSDP2 shards each tensor along dim 0: 53 floats over the ranks, rows of 6 and 5 (weights), 1 (biases)
    if FSDP_ON_CPU:
        fsdp = [r["memory"][("sgd", "fsdp", None, None, None)]["params"] for r in ranks]
        assert sum(fsdp) == 53 * 4
    if world == 2:  # resume from the ZeRO-3 and FSDP shards: bit-identical; a corrupt shard on rank 1 stops both
        for key in ("resume", "resume_fsdp") if FSDP_ON_CPU else ("resume",):
            (identical0, message0), (identical1, message1) = (r[key] for r in ranks)
            assert identical0 and identical1, key
            assert message0 == message1, key  # the same words on every rank: the job prints them once
            assert "the checkpoint file of rank 1 in" in message0 and "is corrupt or not a labkit checkpoint" in message0


def _resume(env, tmp, name, options):
    """2 epochs straight, a checkpoint after each (in a folder per epoch); a fresh start resumed from the first:
    identical; then a corrupt shard."""
    def run(epochs, path, resume_from=None):
        strategy, model, opt, loader = _setup(env, name, options, "adam")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        start = load_training_state(resume_from, strategy, model, opt, sched, None)["epoch"] if resume_from else 0
        fit(model, loader, None, opt, epochs=epochs, strategy=strategy, start_epoch=start, scheduler=sched,
            printer=lambda s: None, on_epoch_end=lambda e: save_training_state(
                strategy.checkpoint_file(path / f"epoch{e + 1}"), strategy, model, opt, sched, None,
                {"epoch": e + 1}, {}))
        return _full(strategy, model), strategy.checkpoint_file(path / "epoch1")

    straight, ckpt = run(2, tmp / "straight")
    resumed, _ = run(2, tmp / "resumed", resume_from=ckpt)
    identical = all(torch.equal(p, q) for p, q in zip(straight, resumed, strict=True))
    if env.rank == 1:
        ckpt.write_bytes(b"not a checkpoint")
    torch.distributed.barrier()
    try:
        run(2, tmp / "again", resume_from=ckpt)
        message = None
    except CheckpointError as exc:
        message = str(exc)
    return identical, message


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "zero", "--zero-stage", "4"], "--zero-stage must be >= 1 and <= 3, got 4"),
    (["--strategy", "zero", "--zero-prefetch"], "--zero-prefetch gathers parameters ahead of use"),
    (["--strategy", "zero", "--optimizer", "kfac"], "--optimizer kfac with --strategy zero: K-FAC needs"),
    (["--strategy", "zero", "--optimizer", "lars"], "--optimizer lars with --strategy zero: LARS scales"),
    (["--strategy", "fsdp"], "--strategy fsdp needs a process group: start it with torchrun"),
])
def test_bad_sharding_input_is_one_line_exit_2(argv, message, tmp_path, capsys):
    base = ["train", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "64", "--test-size", "32",
            "--device", "cpu", "--out", str(tmp_path)]
    try:
        code = main(base + argv)
    except SystemExit as exc:  # a flag argparse refuses
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_zero_stage3_on_one_rank_trains_like_a_single_device(tmp_path):
    base = ["train", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "64", "--test-size", "32",
            "--batch-size", "16", "--device", "cpu", "--epochs", "1", "--optimizer", "adam", "--log-every", "100"]
    assert main(base + ["--out", str(tmp_path / "single")]) == 0
    assert main(base + ["--strategy", "zero", "--zero-stage", "3", "--out", str(tmp_path / "zero")]) == 0
    single, zero = (json.loads((tmp_path / r / "summary.json").read_text())["metrics"] for r in ("single", "zero"))
    assert zero["final_train_loss"] == pytest.approx(single["final_train_loss"], abs=1e-6)
    assert zero["final_test_acc"] == single["final_test_acc"]
    assert (tmp_path / "zero" / "checkpoint.rank0.pt").exists()



def test_zero_stage1_checker_passes_the_answer_and_names_each_mistake():
    from labkit.exercises import zero_stage1

    assert zero_stage1.check(zero_stage1.reference) == []
    namespace = {}
    exec(zero_stage1.STARTER, namespace)
    assert "every rank returned the same slice" in zero_stage1.check(namespace["zero1_step"])[0]

    def plain_sgd(p, g, m, rank, world, lr, mu):
        s = slice(rank * (p.numel() // world), (rank + 1) * (p.numel() // world))
        return p[s] - lr * g[s]

    def in_place(p, g, m, rank, world, lr, mu):
        s = slice(rank * (p.numel() // world), (rank + 1) * (p.numel() // world))
        m.mul_(mu).add_(g[s])
        p[s] -= lr * m
        return p[s].clone()

    assert "this is plain SGD" in zero_stage1.check(plain_sgd)[0]
    assert "modified flat_param" in zero_stage1.check(in_place)[0]
    assert "shape (7,)" in zero_stage1.check(lambda p, g, m, rank, world, lr, mu: p)[0]


def test_buckets_are_cut_from_the_last_module_back_and_print_buckets_needs_zero():
    from labkit.errors import ConfigError
    from labkit.parallel.dp import read_options
    from labkit.parallel.zero_units import plan_buckets

    # bytes of 3 modules: a bucket takes the next module (last first) while it stays within the cap
    assert plan_buckets([400, 4000, 40], 4194) == [[0], [1, 2]]
    assert plan_buckets([400, 4000, 40], 25 * 2**20) == [[0, 1, 2]]
    assert plan_buckets([400, 4000, 40], 1) == [[0], [1], [2]]  # a module larger than the cap: a bucket of its own
    with pytest.raises(ConfigError, match="--print-buckets prints ZeRO's buckets, but --dp-shard none"):
        read_options({"dp_shard": "none", "print_buckets": True})
    assert read_options({"dp_shard": "zero2", "print_buckets": True, "bucket_mb": 0.5}) == ("zero2", "ddp", 0.5)

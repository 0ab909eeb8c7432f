"""What one training step of each strategy sends, counted: nothing the plain version of the step lacks.

One 2-rank gloo job runs 6 steps of :func:`labkit.train.loop.fit` per strategy (each data-parallel preset,
``--strategy ddp`` (``--allreduce ddp`` and ``ring``), ``zero --zero-stage 1|2|3`` and ``fsdp``, besides calls what
``--mesh dp=2`` with the matching ``--allreduce`` / ``--dp-shard`` calls and ends on its bit-identical weights, and
``ddp`` on those of a plain PyTorch DDP loop; and a 2-layer GPT on ``--mesh tp=2``
and ``pp=2``; the 4-rank meshes ``dp=2,cp=2`` and ``dp=2,ep=2`` count their all-reduces in ``tests/test_cp.py``
and ``tests/test_moe.py``) with every ``torch.distributed`` call
the step can make wrapped (its name and element count logged; pipelining's batched sends arrive as their isend/
irecv), DDP's gradient buckets made visible by registering PyTorch's own ``allreduce_hook`` (without a hook its
reducer calls the process group from C++, out of Python's sight), and the log cut at each
``train_step``. Stop check every 2 steps (``StopSignals(every_steps=2)``): launched after steps 0 and 2, each
read a step later; the throughput window's barrier after the warm-up (step 1). The single-process strategies
(single device, model-parallel, GPipe) run in this process and must call nothing.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from labkit.dist import group as kdist
from labkit.dist.group import DistEnv
from labkit.dist.testing import run_ranks
from labkit.optim import OptimizerSpec
from labkit.parallel.dp import fsdp_refusal
from labkit.strategies import get_strategy
from labkit.train import loop as ktrain
from labkit.train.preempt import StopSignals

STEPS, BATCH = 6, 4
CALLS = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
         "reduce_scatter_tensor", "broadcast", "barrier", "gather", "scatter", "send", "recv", "isend", "irecv",
         "all_gather_object", "gather_object", "broadcast_object_list", "reduce", "reduce_scatter", "all_to_all",
         "all_to_all_single", "monitored_barrier")
STOP = "all_reduce 2"  # the stop check: [this rank's flag, rank 0's next interval]
#: FSDP2 runs on CPU ranks from torch 2.7 on (labkit refuses it before, labkit.parallel.dp.fsdp_refusal): its runs
#: are left out on an older torch
FSDP_ON_CPU = fsdp_refusal("--strategy fsdp", "cpu") is None


def _numel(args, kwargs) -> int:
    """Elements of the call's first tensor (an all-gather's or reduce-scatter's output comes first)."""
    first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
    return 0 if first is None else first.numel()


def _counting(log: list):
    """Wrap every collective and point-to-point call of torch.distributed; return the originals. isend/irecv
    are wrapped in distributed_c10d too: a P2POp (pipelining's batched sends) accepts only those two."""
    originals = {name: getattr(dist, name) for name in CALLS if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            log.append(f"{name} {_numel(args, kwargs)}")
            return fn(*args, **kwargs)
        return counted
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    for name in ("isend", "irecv"):
        setattr(c10d, name, getattr(dist, name))
    return originals


def _restore(originals: dict) -> None:
    for name, fn in originals.items():
        setattr(dist, name, fn)
        if name in ("isend", "irecv"):
            setattr(c10d, name, fn)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(channels=3, size=2) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, channels, size, size, generator=g), torch.randint(0, 3, (96,), generator=g))


def _gpt():
    from labkit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8, dropout=0.0))


def _tokens() -> TensorDataset:
    tokens = torch.randint(0, 16, (96, 5), generator=torch.Generator().manual_seed(1))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _steps(name: str, options: dict, env, model: nn.Module, data: TensorDataset, log: list,
           weights: list | None = None) -> list[list[str]]:
    """The calls of each of the STEPS steps, from one train_step to the next (the last one to the epoch's end);
    with ``weights``, the parameters after the last step appended to it."""
    strategy = get_strategy(name)(env, options)
    task = None
    if isinstance(data.tensors[1], torch.Tensor) and data.tensors[1].ndim == 2:  # next-token targets: a GPT
        from labkit.train.tasks import LanguageModelling

        strategy.check_model("gpt-tiny")
        task = LanguageModelling()
    model = strategy.prepare(model)
    if isinstance(model, DistributedDataParallel):  # PyTorch's own hook: the same all-reduce, called from Python
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    optimizer, _ = strategy.build_optimizer(model, OptimizerSpec("sgd", 0.01, 0.9, env=env))
    loader = DataLoader(data, BATCH, sampler=strategy.sampler(data, True, 0), drop_last=True)
    cuts = []
    step = ktrain.train_step

    def marked(*args, **kwargs):
        cuts.append(len(log))
        return step(*args, **kwargs)
    ktrain.train_step = marked
    start = len(log)
    try:
        ktrain.fit(model, loader, None, optimizer, epochs=1, strategy=strategy, max_steps=STEPS,
                   printer=lambda line: None, stop=StopSignals(every_steps=2), task=task)
    finally:
        ktrain.train_step = step
    cuts.append(len(log))
    if weights is not None:  # whole: ZeRO-3's gathered, FSDP2's DTensors' full tensors
        with strategy.whole_parameters():
            weights.extend(p.full_tensor().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
                           for p in strategy.unwrap(model).parameters())
    strategy.close()
    assert cuts[0] == start, log[start:cuts[0]]
    return [log[a:b] for a, b in zip(cuts, cuts[1:])]


def _plain_ddp(env) -> list[torch.Tensor]:
    """The same 6 steps in a plain PyTorch DDP loop (the same net, shards and SGD): its final weights."""
    from torch.utils.data import DistributedSampler

    model = DistributedDataParallel(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = _data()
    loader = DataLoader(data, BATCH, sampler=DistributedSampler(data, 2, env.rank, shuffle=True, seed=0, drop_last=True),
                        drop_last=True)
    for _, (x, y) in zip(range(STEPS), loader):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.module.parameters()]


def _ranks(env) -> dict:
    log: list[str] = []
    originals = _counting(log)
    try:
        from labkit.models import cnn as models

        lenet = models.get_model("lenet", num_classes=3, in_channels=1, image_size=28)
        lenets = [copy.deepcopy(lenet) for _ in LENET_ZERO]
        alexnet = models.get_model("alexnet_small", num_classes=3, in_channels=3, image_size=16)
        runs = {"ddp": ("ddp", {}, _net(), _data()),
                "lenet-ddp": ("ddp", {}, lenet, _data(1, 28)),
                **{key: ("zero", options, net, _data(1, 28)) for (key, options), net in zip(LENET_ZERO.items(), lenets)},
                "zero-1": ("zero", {"zero_stage": 1}, _net(), _data()),
                "zero-2": ("zero", {"zero_stage": 2}, _net(), _data()),
                "zero-3": ("zero", {"zero_stage": 3}, _net(), _data()),
                "fsdp": ("fsdp", {}, _net(), _data()),
                "ddp-ring": ("ddp", {"allreduce": "ring"}, _net(), _data()),
                "mesh-dp": ("mesh", {"mesh": "dp=2"}, _net(), _data()),
                "mesh-fsdp": ("mesh", {"mesh": "dp=2", "dp_shard": "fsdp"}, _net(), _data()),
                "mesh-zero-1": ("mesh", {"mesh": "dp=2", "dp_shard": "zero1"}, _net(), _data()),
                "mesh-zero-2": ("mesh", {"mesh": "dp=2", "dp_shard": "zero2"}, _net(), _data()),
                "mesh-zero-3": ("mesh", {"mesh": "dp=2", "dp_shard": "zero3"}, _net(), _data()),
                "mesh-ring": ("mesh", {"mesh": "dp=2", "allreduce": "ring"}, _net(), _data()),
                "mesh-tp": ("mesh", {"mesh": "tp=2"}, _gpt(), _tokens()),
                "gpt-ddp": ("mesh", {"mesh": "dp=2"}, _gpt(), _tokens()),
                "gpt-zero-3": ("zero", {"zero_stage": 3}, _gpt(), _tokens()),
                "mesh-pp": ("mesh", {"mesh": "pp=2", "num_microbatches": 2}, _gpt(), _tokens()),
                "hybrid": ("hybrid", {}, alexnet, _data(3, 16)),
                "tensor-parallel": ("tensor-parallel", {}, _net(), _data()),
                "pipeline": ("pipeline", {"num_microbatches": 2}, _net(), _data()),
                "ps": ("ps", {"ps_mode": "sync", "ps_timeout_s": 60}, _net(), _data())}
        runs = {key: run for key, run in runs.items() if FSDP_ON_CPU or "fsdp" not in key}
        weights: dict[str, list] = {key: [] for pair in PRESETS.items() for key in pair}
        weights.update({key: [] for key in ["lenet-ddp", *LENET_ZERO, "gpt-ddp", "gpt-zero-3"]})
        steps = {key: _steps(name, options, env, model, data, log, weights.get(key))
                 for key, (name, options, model, data) in runs.items()}
        weights["plain-ddp"] = _plain_ddp(env)
        return {**steps, "weights": weights}
    finally:
        _restore(originals)


#: ZeRO on LeNet (3 classes: conv1 156, conv2 2,416, fc1 30,840, fc2 10,164, fc3 255 parameters): the default
#: 25 MB bucket holds all 43,831; 0.05 MB (13,107 floats), filled from the last layer back, cuts three buckets,
#: [conv1, conv2] 2,572, [fc1] 30,840, [fc2, fc3] 10,419 (10,420 padded)
LENET_ZERO = {"lenet-zero-1": {"zero_stage": 1}, "lenet-zero-2": {"zero_stage": 2, "bucket_mb": 0.05},
              "lenet-zero-3": {"zero_stage": 3, "bucket_mb": 0.05, "zero_prefetch": True}}
#: each data-parallel preset's run and the ``--mesh dp=2`` run it stands for
PRESETS = {"ddp": "mesh-dp", "ddp-ring": "mesh-ring", "zero-1": "mesh-zero-1", "zero-2": "mesh-zero-2",
           "zero-3": "mesh-zero-3", **({"fsdp": "mesh-fsdp"} if FSDP_ON_CPU else {})}
#: what the loop adds after steps 0..5: the stop check launched after steps 0 and 2 (read after 1 and 3; none
#: after 4, whose answer would come after the last step), the window's barriers after the warm-up and at the end,
#: and the epoch's metric sums (loss, correct, count)
LOOP = [[STOP], ["barrier 0"], [STOP], [], [], ["barrier 0", "all_reduce 3"]]
#: the single-tensor all-gather and reduce-scatter under the names this torch gives them (all_gather_single and
#: reduce_scatter_single from 2.13 on, all_gather_into_tensor and reduce_scatter_tensor before): labkit's ZeRO calls
#: them through labkit.dist.group, PyTorch's FSDP2 by itself, and the two must agree
AG, RS = kdist.ALL_GATHER_TENSOR, kdist.REDUCE_SCATTER_TENSOR
#: the net: Linear(12, 8) (104 parameters) and Linear(8, 3) (27, padded to 28 for 2 ranks, FSDP2: 36 by rows)
STEP = {
    "ddp": ["all_reduce 131"],  # one gradient bucket: all 131 parameters
    "lenet-ddp": ["all_reduce 43831"],  # LeNet's 43,831 parameters fit DDP's first 1 MB bucket
    # ZeRO-1/2: both layers in one 25 MB bucket (132 elements padded): reduce-scatter its gradient inside
    # backward (a shard of 66), all-gather its stepped parameters
    "zero-1": [f"{RS} 66", f"{AG} 132"],
    "zero-2": [f"{RS} 66", f"{AG} 132"],
    # ZeRO-3: gather the bucket for the forward, again for the backward, reduce-scatter its gradient
    "zero-3": [f"{AG} 132", f"{AG} 132", f"{RS} 66"],
    # the 2-layer GPT (1,920 parameters, its head tied to the embedding: one bucket): DDP's all-reduce over dp=2;
    # ZeRO-3 gathers for the forward (the tied head keeps the bucket until it has run), again for the backward
    "gpt-ddp": ["all_reduce 1920"],
    "gpt-zero-3": [f"{AG} 1920", f"{AG} 1920", f"{RS} 960"],
    # LeNet, one bucket: one reduce-scatter and one all-gather per step, as DDP's one all-reduce
    "lenet-zero-1": [f"{RS} 21916", f"{AG} 43832"],
    # three buckets: reduce-scatter each as backward completes it (the last first), all-gather all three
    "lenet-zero-2": [f"{RS} 5210", f"{RS} 15420", f"{RS} 1286", f"{AG} 2572", f"{AG} 30840", f"{AG} 10420"],
    # stage 3, a bucket ahead: each bucket's gather is launched while the one before it computes
    "lenet-zero-3": [f"{AG} 2572", f"{AG} 30840", f"{AG} 10420", f"{AG} 10420", f"{AG} 30840", f"{RS} 5210",
                     f"{AG} 2572", f"{RS} 15420", f"{RS} 1286"],
    "fsdp": [f"{AG} 104", f"{AG} 36", f"{AG} 36", f"{AG} 104", f"{RS} 18", f"{RS} 52"],
    # --mesh dp=2: labkit's bucketed all-reduce over the dp group after backward (131 parameters, one bucket);
    # --dp-shard fsdp: FSDP2 over the dp group, the same calls as --strategy fsdp
    "mesh-dp": ["all_reduce 131"],
    "mesh-fsdp": [f"{AG} 104", f"{AG} 36", f"{AG} 36", f"{AG} 104", f"{RS} 18", f"{RS} 52"],
    # --dp-shard zero2: labkit's ZeRO over the dp group, the same calls as --strategy zero --zero-stage 2
    "mesh-zero-2": [f"{RS} 66", f"{AG} 132"],
    # shard sizes (host memory), features and targets to rank 0, their gradients and logits back, the
    # convolutions' gradients summed (565,152 parameters, one bucket)
    "hybrid": [f"{AG} 2", "gather 2048", "gather 4", "scatter 2048", "scatter 12", "all_reduce 565152"],
    # Megatron's row-parallel output: one all-reduce of the logits (4 × 3); the input needs no gradient
    "tensor-parallel": ["all_reduce 12"],
}
STEP = {key: calls for key, calls in STEP.items() if FSDP_ON_CPU or "fsdp" not in key}
#: pipeline, 2 micro-batches of 2 rows: rank 0 sends each one's activations (2 × 8) and receives their gradients
PIPE = {0: ["isend 16", "isend 16", "irecv 16", "irecv 16"], 1: ["irecv 16", "irecv 16", "isend 16", "isend 16"]}
#: the first step also agrees on the shapes between the stages
PIPE_FIRST = {0: ["send 1", "isend 1", "recv 1", "irecv 1", "isend 1", "isend 161", "irecv 1", "irecv 162"],
              1: ["recv 1", "irecv 1", "send 1", "isend 1", "irecv 1", "irecv 161", "isend 1", "isend 162"]}
#: --mesh tp=2, a 2-layer GPT (vocabulary 16, C = 8) on batches of 4 sequences of 4 tokens: activations of
#: 4 x 4 x 8 = 128; forward: the vocabulary-parallel embedding's all-reduce and each block's two row-parallel
#: outputs (attention, MLP); the vocabulary-parallel loss's max (4 x 4) and its sums (2 x 4 x 4); backward: the
#: tied head's input and each block's two column-parallel inputs (MLP, q/k/v together). No gradient all-reduce.
MESH_TP = ["all_reduce 128"] * 5 + ["all_reduce 16", "all_reduce 32"] + ["all_reduce 128"] + ["all_reduce 128"] * 4
#: --mesh pp=2, the same GPT, 2 micro-batches of 2 sequences: activations (2 x 4 x 8) forward and their gradients
#: back, then the tied embedding's gradient (16 x 8) summed over the first and last stage
MESH_PP = {0: ["isend 64", "isend 64", "irecv 64", "irecv 64", "all_reduce 128"],
           1: ["irecv 64", "irecv 64", "isend 64", "isend 64", "all_reduce 128"]}
MESH_PP_FIRST = {0: ["send 1", "isend 1", "recv 1", "irecv 1", "isend 1", "isend 165", "irecv 1", "irecv 166"],
                 1: ["recv 1", "irecv 1", "send 1", "isend 1", "irecv 1", "irecv 165", "isend 1", "isend 166"]}
#: the first step's shape exchange is PyTorch's own protocol: PIPE_FIRST and MESH_PP_FIRST are torch 2.14's (the
#: pinned release); torch 2.6 sends the shapes its own way (rank 0 of the pipeline: isend 1, isend 103)
SHAPES_LITERAL = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14)


def _shapes(literal: list[str], first: list[str], rest: list[str]) -> list[str]:
    """The calls of the first step before its steady ones: the literal on the pinned torch; on an older one, what it
    sent, checked to be point to point only."""
    if SHAPES_LITERAL:
        return literal
    exchange = first[:len(first) - len(rest)]
    assert exchange and all(c.split()[0] in ("send", "recv", "isend", "irecv") for c in exchange), first
    return exchange


PUSH, REPLY = ["irecv 131"], ["isend 2", "isend 131"]  # ps server: a worker's gradient in; header and parameters out


def test_a_step_sends_what_its_strategy_needs_and_the_stop_check_one_collective_every_2_steps(one_thread):
    per_rank = run_ranks(_ranks, 2, timeout=300)
    for rank, got in enumerate(per_rank):
        for key, body in STEP.items():
            assert got[key] == [body + extra for extra in LOOP], (rank, key, got[key])
        pipe = [PIPE[rank] + extra for extra in LOOP]
        pipe[0] = _shapes(PIPE_FIRST[rank], got["pipeline"][0], pipe[0]) + pipe[0]
        assert got["pipeline"] == pipe, (rank, got["pipeline"])
        assert got["mesh-tp"] == [MESH_TP + extra for extra in LOOP], (rank, got["mesh-tp"])
        mesh_pp = [MESH_PP[rank] + extra for extra in LOOP]
        mesh_pp[0] = _shapes(MESH_PP_FIRST[rank], got["mesh-pp"][0], mesh_pp[0]) + mesh_pp[0]
        assert got["mesh-pp"] == mesh_pp, (rank, got["mesh-pp"])
        # --mesh dp=2 --dp-shard zero2 trains to the bit-identical weights of --strategy zero --zero-stage 2
        zero, mesh_zero = got["weights"]["zero-2"], got["weights"]["mesh-zero-2"]
        assert len(zero) == len(mesh_zero) == 4
        assert all(torch.equal(a, b) for a, b in zip(zero, mesh_zero, strict=True)), rank
        # every preset: the calls and the bit-identical weights of its mesh; --strategy ddp those of plain DDP too
        for preset, mesh in PRESETS.items():
            calls = [list(step) for step in got[mesh]]
            # the group's first point-to-point schedule, here the preset's, starts on a barrier
            # (labkit.collectives.execute): once per group, in the run first to use it; on torch 2.6 the mesh's
            # dp group is another group than the preset's, so its first schedule starts on its own barrier too
            if preset == "ddp-ring" and calls[0][:1] != ["barrier 0"]:
                calls[0].insert(0, "barrier 0")
            assert got[preset] == calls, (rank, preset, got[preset], got[mesh])
            ours, theirs = got["weights"][preset], got["weights"][mesh]
            assert len(ours) == len(theirs) == 4
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (rank, preset)
        assert all(torch.equal(a, b) for a, b in zip(got["weights"]["ddp"], got["weights"]["plain-ddp"], strict=True))
        # ZeRO-3 trains the tied GPT to the bit-identical weights of the dp all-reduce
        gpt, gpt_ddp = got["weights"]["gpt-zero-3"], got["weights"]["gpt-ddp"]
        assert len(gpt) == len(gpt_ddp) == 36 and all(torch.equal(a, b) for a, b in zip(gpt, gpt_ddp)), rank
        # ZeRO in buckets trains LeNet to DDP's bit-identical weights
        for key in LENET_ZERO:
            assert len(got["weights"][key]) == len(got["weights"]["lenet-ddp"]) == 10
            assert all(torch.equal(a, b) for a, b in zip(got["weights"][key], got["weights"]["lenet-ddp"])), key
    # ps, rank 1 the worker: push its gradient, wait for the header and the parameters; the epoch's end
    # broadcasts the server's shard
    ps = [["isend 131", "irecv 2", "irecv 131"] + extra for extra in LOOP]
    ps[5][-1:-1] = ["broadcast 131"]
    assert per_rank[1]["ps"] == ps, per_rank[1]["ps"]
    # rank 0 the server answers a push before the loop's next collective, else at the next step's start
    server = [PUSH + REPLY + LOOP[0], PUSH + REPLY + LOOP[1], PUSH + REPLY + LOOP[2], PUSH, REPLY + PUSH,
              REPLY + PUSH + REPLY + ["barrier 0", "broadcast 131", "all_reduce 3"]]
    assert per_rank[0]["ps"] == server, per_rank[0]["ps"]


def test_single_process_strategies_call_no_collective(one_thread):
    log: list[str] = []
    originals = _counting(log)
    try:
        env = DistEnv()
        for name, options in (("single", {}), ("model-parallel", {"mp_devices": 2}), ("gpipe", {"partitions": 2})):
            steps = _steps(name, options, env, _net(), _data(), log)
            assert steps == [[]] * 6, (name, steps)
    finally:
        _restore(originals)


def test_rank0_turns_its_step_time_into_the_steps_between_two_checks(monkeypatch):
    """every_s = 0.2: 10 ms steps are checked every 20 steps, 0.5 s steps after every step, 1 µs steps every 1000
    (the cap); the first check comes after one step, before any step was timed."""
    import types

    from labkit.train.preempt import StopCheck

    now = [0.0]
    monkeypatch.setattr("labkit.train.preempt.time.perf_counter", lambda: now[0])
    strategy = types.SimpleNamespace(env=DistEnv())
    check = StopCheck(StopSignals(every_s=0.2), strategy, steps=10 ** 6)
    assert check._interval(0) == 1.0
    got = []
    for step, seconds in ((20, 0.01), (40, 0.5), (60, 1e-6)):
        check.next = step  # a check was launched and read: the next interval is timed since the last launch
        now[0] += 20 * seconds
        got.append(check._interval(step))
    assert got == [20.0, 1.0, 1000.0]


def test_the_throughput_window_opens_after_the_warm_up_and_closes_at_the_end_on_a_barrier():
    from labkit.train.meters import ThroughputMeter

    meets = []
    meter = ThroughputMeter(1, 1, steps=10, printer=lambda line: None, barrier=lambda: meets.append(meter.step))
    for _ in range(10):
        meter.update(4)
    assert meets == [1]  # after the 2 warm-up steps (0 and 1)
    assert meter.finish() > 0 and meets == [1, 9] and meter.timed_steps == 8 and meter.window_s > 0
    meets.clear()
    meter = ThroughputMeter(1, 1, steps=5, printer=lambda line: None, barrier=lambda: meets.append("meet"))
    assert meets == ["meet"]  # too short to spare a warm-up: the window opens before the first step

"""What a strategy's own machinery costs per collective on this machine (ZeRO, FSDP2, DDP, tensor parallelism),
measured by running it.

The α-β fit times messages in a tight loop; a sharded strategy launches its collectives from inside a training
step — one or more per unit — through Python hooks that copy, allocate and wait. On a CPU that fixed part is
far larger than α (measured on 2 gloo ranks: 0.6–2.5 ms per collective in a step, α ≈ 0.2 ms), and it differs
between ZeRO's hooks and FSDP2's. So each sharded strategy is run for real on a calibration chain and its price
per collective is what the step costs beyond the same chain's plain step, less the bytes:

    c_s = (T_s − T_0 − bytes_s) / N_s

``T_s`` the strategy's step (the slowest rank's lower quartile of 9 windows), ``T_0`` the plain step of the same chain on each rank at
the same time (no collectives), ``bytes_s`` and ``N_s`` the bytes and the number of reduce-scatters and
all-gathers the cost model prices for that step (:func:`labkit.advisor.cost_sharded.bytes_time`,
:func:`collective_count`). ZeRO also broadcasts every buffer before each forward: tiny tensors back to back,
far cheaper each than a reduce-scatter in a step (measured 0.23–0.25 ms against 1.1–1.6 ms), so they have a price
of their own (key ``zero-broadcast``: the chain's buffers broadcast in a loop, per broadcast), taken off ZeRO's
step before dividing. The chain: six units of 3×3 convolution (32 → 32 channels) with batch norm, and a Linear,
on 32 samples of 32×16×16 per rank — convolutions of the size the kit's CIFAR models train, so the collectives
sit between computations as theirs do.
Data parallelism's all-reduces get the same treatment as a κ of their own: keys ``ddp`` (PyTorch's DDP: its
buckets and its buffer broadcast) and ``ddp-kit`` (the kit's schedules, measured with ring) — the chain's step under
``--strategy ddp`` less the plain step and the α-β-γ price of what it sends, over the collectives launched. They
are measured on the chain with 8 channels: the fixed price of a launch shows best where little computation sits
between two synchronisations (with more, the ranks drift apart and each synchronisation also waits for the slower
one — a share of the step that a large model's step hides).
Tensor parallelism is priced the same way (key ``tensor-parallel``): two column/row pairs after a convolution
(so that the first pair's input gradient is all-reduced too), 4 all-reduces a step, against the plain step of
the layers each rank holds (the sliced shapes) and the all-reduces' bytes on a ring. The convolution (3 → 16
channels, 5×5, then a 2×2 pooling) is a CNN feature extractor's worth of work, about 2.5 ms a step here: the
ranks reach the first all-reduce after real computation, drift apart on the way and the first to arrive
sleeps, as in a CNN whose classifier is sliced. Behind a convolution a tenth that size the price came out
0.97–1.25 ms per all-reduce while LeNet's own all-reduces cost 1.44–1.60 ms in the same minutes; behind this
one 1.17–1.23 ms against LeNet's 1.16–1.50 ms.
The multi-process pipeline (``torch.distributed.pipelining``) pays a price per micro-batch and stage (keys
``pipeline-m2``, ``-m4``, ``-m8``: ``h`` at that many micro-batches): the schedule's Python for one forward and one
backward chunk, its send and receive operations and the wake-ups they cost beyond α-β (measured on 2 gloo ranks:
a 2-stage pipeline of two tiny Linears, nothing to compute, took 1.0, 1.8, 4.0, 6.6 ms a step at m = 1, 2, 4, 8,
its messages α-β 0.3 ms a micro-batch). The 8-channel chain is cut into ``p`` stages
(:func:`labkit.strategies.pipelining.even_balance`), run with ``m`` micro-batches, and ``h`` is what its step takes
beyond the same step priced without it. The pipeline's price grows by ``m + p − 1`` slots of ``h`` (every stage
pays it per micro-batch; along the critical path of :func:`labkit.advisor.cost.pipeline_terms` the slowest stage
``m`` times, every other stage once), so

    h = (T_pipe − update − T_0) / (m + p − 1),   T_0 = m·τ_{j*} + Σ_{j≠j*} τ_j,   τ_j = t_j + c_j

``t_j`` stage ``j``'s plain forward + backward of one micro-batch (its own rank's; the chain's first stages hold
more of its convolutions, so stage 0 is the slowest), ``c_j = 2·(α + β·n_cut)`` its messages (0 for the last),
``n_cut`` the bytes of one micro-batch's activation at a cut (every cut of the chain carries the same shape),
``update`` the optimizer step of the slowest rank's stage. ``h`` grows with ``m``, on the chain and on LeNet
alike (2 gloo ranks, 2 rounds, the same formula: the chain 0.10–0.42, 0.70–0.88, 1.07–1.28 ms at m = 2, 4, 8;
LeNet cut ``[3, 9]`` 0.39–0.48, 0.95–1.15, 0.65–0.92 ms), so one price taken at ``m = 4`` put LeNet's ``m = 2``
pipeline 20 % high: it is measured at each ``m`` and :func:`labkit.advisor.cost.pipeline_overhead` interpolates.
A byte costs more in a step, too. The α-β fit sends point-to-point messages of at most 1 MB back to back, its
buffers warm in the caches; a training step launches its collectives after a forward and backward that filled the
caches with activations, and the bytes of a large all-reduce then cost more each (2 gloo ranks, one thread each,
``dist.all_reduce`` right after AlexNet-small's step on 32 samples against the same all-reduce in a loop, 2
rounds: 4 MB 5.7–6.1 ms vs 3.7–4.2, 8 MB 10.4–12.1 ms vs 7.4–8.3, 16 MB 18.4–19.4 ms vs 14.5–14.7); even in a
loop an 8 MB all-reduce (6.6–7.0 ms) costs more than the fit prices it (5.5 ms). So the topology keeps a factor
``f`` on β and γ for whatever a step sends (:func:`bytes_in_step`, ``Topology.step_bytes``): the slope in bytes of
an all-reduce after the chain's step over the fit's slope, between two sizes (κ and α, the fixed part, cancel):

    f = (T(step + AR(n₂)) − T(step + AR(n₁))) / (AR_fit(n₂) − AR_fit(n₁)),   n₁ = 1 MB, n₂ = 8 MB

(15 alternating pairs of windows, the median of their differences). The prices above subtract the bytes they
counted at that price.
Run once per topology, inside the ranks that fit the link (:func:`labkit.advisor.topology.measure_link`).
"""
from __future__ import annotations

import contextlib
import io
import statistics
from dataclasses import replace

import torch
from torch import nn

from labkit.advisor.cost import (
    broadcast_time,
    bucket_count,
    bucketed_allreduce,
    ddp_key,
    pipeline_terms,
    ring_bytes_time,
)
from labkit.advisor.cost_sharded import BROADCAST_KEY, buffer_broadcasts, bytes_time, call_key, collective_count

#: the strategies priced per collective: (strategy, options, stage the cost model uses)
SHARDED = [("zero", {"zero_stage": 1}, 1), ("zero", {"zero_stage": 2}, 2), ("zero", {"zero_stage": 3}, 3),
           ("fsdp", {}, 3), ("fsdp", {"fsdp_no_reshard": True}, 2)]
CHANNELS, SIZE, BATCH = 32, 16, 32


def chain(channels: int = CHANNELS) -> nn.Sequential:
    """The calibration chain: 6 × (conv 3×3, batch norm, ReLU), flatten, Linear to 10 classes (13 units)."""
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                           nn.ReLU())]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * SIZE * SIZE, 10))


def _bytes_of(model: nn.Module) -> tuple[float, int, int]:
    """(parameter bytes, buffer tensors, buffer bytes)."""
    return (float(sum(p.numel() * p.element_size() for p in model.parameters())), sum(1 for _ in model.buffers()),
            sum(b.numel() * b.element_size() for b in model.buffers()))


HIDDEN, TP_BATCH, TP_CHANNELS, TP_SIZE = 256, 32, 16, 16
TP_FEATURES = TP_CHANNELS * (TP_SIZE // 2) ** 2  # the first pair's input features


def mlp_chain(world: int = 1) -> nn.Sequential:
    """Tensor parallelism's calibration chain: a 5×5 convolution (3 → 16 channels) and pooling, then two Linear
    pairs of ``HIDDEN`` features (``world`` > 1: the layers one rank of ``world`` holds once the pairs are
    sliced). Input: ``TP_BATCH`` samples of 3 × ``TP_SIZE`` × ``TP_SIZE``."""
    torch.manual_seed(0)
    h = HIDDEN // world
    return nn.Sequential(nn.Conv2d(3, TP_CHANNELS, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(TP_FEATURES, h), nn.ReLU(), nn.Linear(h, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, h),
                         nn.ReLU(), nn.Linear(h, HIDDEN))


def _time_step(env, model: nn.Module, x, y, criterion, per_call, calls: int, strategy: str | None = None,
               options: dict | None = None) -> float:
    """Seconds per training step of ``model`` (the slowest rank's lower quartile of 9 windows of ``calls`` steps),
    plain or under ``strategy``, driven as :func:`labkit.train.fit` drives a strategy.

    The lower quartile, not the median: other programs only ever slow a window down, and a price is a difference
    of two steps (the strategy's less the plain one), so one slow spell in either moved it by 2× between fits
    (FSDP's price per collective 3.3 ms in one fit, 6.6 ms in another, minutes apart)."""
    step = _step_fn(env, model, x, y, criterion, strategy, options)
    step()  # warm-up: allocations
    return per_call(step, calls, 9, 0.25)


def _step_fn(env, model: nn.Module, x, y, criterion, strategy: str | None = None, options: dict | None = None):
    """One training step of ``model`` on ``(x, y)`` (SGD with momentum), plain or under ``strategy``, as a
    function to call: driven as :func:`labkit.train.fit` drives a strategy."""
    from labkit.optim import OptimizerSpec
    from labkit.strategies import get_strategy

    strat = None
    if strategy is None:
        opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
    else:
        strat = get_strategy(strategy)(env, options)
        model = strat.prepare(model)
        opt, _ = strat.build_optimizer(model, OptimizerSpec("sgd", 1e-9, 0.9, 0.0, {}, env))

    def step():
        opt.zero_grad(set_to_none=True)
        if strat is None:
            criterion(model(x), y).backward()
        else:
            strat.forward_backward(model, x, y, criterion)
            strat.sync_gradients(model)
        opt.step()

    return step


def calibrate_rank(env, link, per_call) -> dict[str, float]:
    """``{call key: c_s seconds}`` for every calibrated strategy; every rank of ``env`` calls it.

    ``link``: the α-β-γ fit of these ranks (prices the bytes); ``per_call(fn, calls, windows, quantile=0.5,
    each=False)``: seconds per call of ``fn``, the slowest rank's ``quantile`` of the windows (``each``: every
    rank's, a list); a collective.
    """
    from labkit.advisor.topology import Topology

    topo = Topology("calibration", env.world_size, link, float("inf"))  # κ = 0: what is left is the price
    x, y = torch.randn(BATCH, CHANNELS, SIZE, SIZE), torch.randint(0, 10, (BATCH,))
    criterion = nn.CrossEntropyLoss()
    plain = chain()
    units = [float(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)))
             for m in plain.modules() if any(True for _ in m.parameters(recurse=False))]
    _, buffers, buffer_bytes = _bytes_of(plain)
    base = _time_step(env, plain, x, y, criterion, per_call, 3)
    out = {BROADCAST_KEY: _broadcast_price(plain, per_call)}
    priced = replace(topo, call_s=dict(out))
    broadcasts = buffer_broadcasts((buffers, buffer_bytes), env.world_size, priced)  # ZeRO's, as the model prices them
    for name, options, stage in SHARDED:
        extra = (_time_step(env, chain(), x, y, criterion, per_call, 3, name, options) - base
                 - bytes_time(units, env.world_size, stage, topo) - (broadcasts if name == "zero" else 0.0))
        out[call_key(name, stage)] = max(0.0, extra) / collective_count(stage, len(units))
    out.update(_data_parallel(env, topo, per_call, criterion))
    out["tensor-parallel"] = _tensor_parallel(env, link, per_call, criterion)
    for m in PIPE_MICROBATCHES:
        out[f"pipeline-m{m}"] = _pipeline(env, link, per_call, criterion, m)
    return out


STEP_BYTES = (1 << 20, 8 << 20)  # n₁, n₂: the all-reduces whose slope in bytes gives f
PAIRS = 15                       # windows of the step with n₂ and with n₁, alternating


def bytes_in_step(per_call, link, ranks: int) -> float:
    """``f`` (see the module's docstring): how many times the α-β-γ fit's price a byte of a collective launched
    right after a training step costs, at least 1. The chain's plain step followed by an all-reduce of ``n₂``
    and of ``n₁`` bytes, one window each, alternating (the median of the pairs' differences), over the fit's price
    of the same bytes on a ring (``link``: the fit; ``ranks``: this group's size)."""
    from labkit import dist as kdist

    x, y = torch.randn(BATCH, CHANNELS, SIZE, SIZE), torch.randint(0, 10, (BATCH,))
    step = _step_fn(None, chain(), x, y, nn.CrossEntropyLoss())
    small, large = (torch.ones(n // 4) for n in STEP_BYTES)
    step()  # warm-up: allocations, momentum buffers
    measured = [per_call(lambda: (step(), kdist.all_reduce(large)), 3, 1)
                - per_call(lambda: (step(), kdist.all_reduce(small)), 3, 1) for _ in range(PAIRS)]
    priced = ring_bytes_time(STEP_BYTES[1], ranks, link) - ring_bytes_time(STEP_BYTES[0], ranks, link)
    return max(1.0, statistics.median(measured) / max(1e-12, priced))


def _broadcast_price(model: nn.Module, per_call) -> float:
    """``c_b``: one of ZeRO's buffer broadcasts — every buffer of ``model`` from rank 0, back to back, as ZeRO
    does before each forward — per broadcast (their bytes, 1.6 KB in all on the chain, are left in)."""
    from labkit import dist as kdist

    buffers = list(model.buffers())

    def broadcast_all():
        with torch.no_grad():
            for b in buffers:
                kdist.broadcast(b, src=0)

    return per_call(broadcast_all, 10, 5) / len(buffers)


def _data_parallel(env, topo, per_call, criterion, channels: int = 8) -> dict[str, float]:
    """``{"ddp": c, "ddp-kit": c}``: each DDP flavour's price per collective launched, on the 8-channel chain."""
    x, y = torch.randn(BATCH, channels, SIZE, SIZE), torch.randint(0, 10, (BATCH,))
    nbytes, buffers, buffer_bytes = _bytes_of(chain(channels))
    base = _time_step(env, chain(channels), x, y, criterion, per_call, 3)
    out = {}
    for algo in ("ddp", "ring"):
        priced = bucketed_allreduce(nbytes, env.world_size, algo, topo)  # κ = 0 in this topology
        launches = bucket_count(nbytes, algo)
        if algo == "ddp" and buffers:  # PyTorch's DDP broadcasts the buffers, coalesced, every forward
            priced += broadcast_time(1, buffer_bytes, env.world_size, topo)
            launches += 1
        step = _time_step(env, chain(channels), x, y, criterion, per_call, 3, "ddp", {"allreduce": algo})
        out[ddp_key(algo)] = max(0.0, step - base - priced) / launches
    return out


def _tensor_parallel(env, link, per_call, criterion) -> float:
    """``c_tp``: 2 pairs → 4 all-reduces: forward, each pair's ``TP_BATCH × HIDDEN`` partial sums; backward, each
    pair's input gradient (``TP_BATCH × TP_FEATURES`` floats for the first, ``TP_BATCH × HIDDEN`` the second)."""
    from labkit.strategies.tensor_parallel import parallelize_linears

    p = env.world_size
    x, y = torch.randn(TP_BATCH, 3, TP_SIZE, TP_SIZE), torch.randint(0, HIDDEN, (TP_BATCH,))
    base = _time_step(env, mlp_chain(p), x, y, criterion, per_call, 5)  # the layers one rank holds, no messages
    step = _time_step(env, parallelize_linears(mlp_chain()), x, y, criterion, per_call, 5)
    sent = sum(ring_bytes_time(TP_BATCH * n * 4, p, link) for n in (HIDDEN, HIDDEN, HIDDEN, TP_FEATURES))
    return max(0.0, step - base - sent) / 4


PIPE_MICROBATCHES = (2, 4, 8)  # the micro-batch counts h is measured at (the search tries 2, 4, 8, 16, 32)


def _pipeline(env, link, per_call, criterion, m: int, channels: int = 8) -> float:
    """``h``: the pipeline schedule's price per micro-batch and stage, on the 8-channel chain cut into one stage
    per rank, with ``m`` micro-batches (the formula is in the module's docstring)."""
    from labkit.strategies.pipelining import even_balance, stage_layers

    p = env.world_size
    x, y = torch.randn(BATCH, channels, SIZE, SIZE), torch.randint(0, 10, (BATCH,))
    balance = even_balance(len(chain(channels)), p)
    start = sum(balance[:env.rank])
    mb, mb_y = x[:BATCH // m], y[:BATCH // m]
    with torch.no_grad():
        inp = chain(channels)[:start](mb)
    stage = stage_layers(chain(channels), balance, env.rank)
    inp.requires_grad_(env.rank > 0)
    grad = torch.randn_like(stage(inp)) if env.rank < p - 1 else None
    opt = torch.optim.SGD(stage.parameters(), lr=1e-9, momentum=0.9)

    def plain():  # one micro-batch through this rank's stage, forward and backward
        out = stage(inp)
        if grad is None:
            criterion(out, mb_y).backward()
        else:
            out.backward(grad)

    plain()
    opt.step()  # momentum buffers exist, as in a training step
    times = per_call(plain, 10, 9, 0.25, each=True)  # every stage's t_j
    update = per_call(opt.step, 20, 5)
    with contextlib.redirect_stdout(io.StringIO()):  # the strategy's set-up line is not the advisor's output
        step = _time_step(env, chain(channels), x, y, criterion, per_call, 3, "pipeline",
                          {"num_microbatches": m, "balance": balance})
    cut = (BATCH // m) * channels * SIZE * SIZE * 4  # float32 activation of one micro-batch at any cut
    comm = [2 * link.transfer_time(cut) if j < p - 1 else 0.0 for j in range(p)]
    without = sum(pipeline_terms(times, comm, m, critical_path=True).values())  # the step priced with h = 0
    return max(0.0, (step - update - without) / (m + p - 1))

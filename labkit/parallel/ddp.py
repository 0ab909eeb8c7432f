"""Data parallelism: every rank holds the whole model, trains on its own shard of each batch, and the
gradients are averaged before the optimizer step, so all replicas stay identical.

    torchrun --nproc_per_node 2 -m labkit train --strategy ddp --model lenet --dataset mnist-sample  # CPU, gloo
    torchrun --nproc_per_node 4 -m labkit train --strategy ddp --model resnet32 --dataset cifar10 \\
        --batch-size 128 --scale-lr --warmup-epochs 5                                                # 4 GPUs, NCCL
    ... --allreduce ring      # hand-made: flatten gradients into buckets, ring all-reduce, divide by W
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts 2 ... --resume   # survive a dead rank

After a failure torchrun restarts every rank and ``--resume`` continues from the last epoch's checkpoint.
The variable gives each restart a fresh rendezvous store (torchrun's shared one hands a restarted group
the dead group's addresses, pytorch issue 135712); ``labkit.launch.local`` and the job scripts set it.

The math: rank r computes the mean loss L_r over its B samples. The loss of the global batch of W·B samples
is L = (1/W) Σ_r L_r, hence ∇L = (1/W) Σ_r ∇L_r: an all-reduce (sum) of the gradients divided by the
world size W. DistributedDataParallel does exactly this, overlapping the all-reduce of each gradient
bucket with the rest of the backward pass; ``--allreduce ALGO`` does it after backward with labkit's
own collectives, so the result can be checked against DDP.

``--strategy ddp`` is a preset of ``--mesh dp=N`` (:class:`DDPStrategy`; the work is the dp dimension's,
:mod:`labkit.parallel.dp`): the same collectives, the same weights, bit for bit.
"""
from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import broadcast_time, bucketed_allreduce, common_terms, compute_scale, memory_terms
from labkit.dist.group import DistEnv
from labkit.errors import ConfigError, LabkitError
from labkit.parallel.data_parallel import average_gradients
from labkit.parallel.dp import DataParallelPreset

__all__ = ["DDPStrategy", "PeerFailure", "check_against_ddp", "parse_kill_at", "price_ddp"]

#: ``labkit train`` flags, plain data read without importing this module (see labkit.flags)
FLAGS = [
    {"flag": "--allreduce", "default": "ddp",
     "choices": ["ddp", "native", "ring", "tree", "butterfly", "rabenseifner", "master-worker", "all-to-all",
                 "round-robin"],
     "help": "ddp: DistributedDataParallel; native: dist.all_reduce by hand; an algorithm name: labkit's own "
             "all-reduce schedule"},
    {"flag": "--bucket-mb", "type": "float", "range": "(0, 1e6]", "default": 25.0,
     "help": "gradient bucket size in MB (DDP's bucket_cap_mb, and the hand-made buckets)"},
    {"flag": "--global-batch-size", "type": "int", "range": "[1, inf)", "default": None,
     "help": "samples per step over all ranks; sets --batch-size to this / world size (None: use --batch-size)"},
    {"flag": "--kill-rank-at", "default": None, "metavar": "RANK:STEP",
     "help": "fault-tolerance demo: rank RANK SIGKILLs itself before step STEP (counted from 0 over the whole "
             "run) on torchrun's first attempt only (None: no fault)"},
]
#: ``labkit advise``: ``p`` ranks each on ``B/p`` samples, the cheapest ``--allreduce`` kept (labkit.advisor.search)
ADVISOR = {"price": "labkit.parallel.ddp:price_ddp", "plans": "spread", "batch": "split", "keep": "cheapest",
           "grid": {"allreduce": ["ddp", "ring", "tree", "butterfly", "rabenseifner", "master-worker", "all-to-all",
                                 "round-robin"]}}
#: flags declared once by another module and shared (labkit.flags.module_flags): the replicas' synchronisation
SHARED_FLAGS = {"labkit.parallel.local_sgd": ["--sync", "--sync-every", "--outer-lr", "--outer-momentum"]}
#: ``labkit bench suite``: ranks and extra ``labkit train`` flags of its run
BENCH = {"ranks": 2, "flags": []}
#: backend/device combinations it cannot run on (labkit.strategies.backends): the kit's schedules send point to point
BACKENDS = [
    {"unless": {"allreduce": ["ddp", "native"]}, "backend": "gloo", "device": "cuda",
     "why": "labkit's --allreduce schedules send and receive point to point, which gloo does on CPU tensors only; "
            "use --backend nccl on GPUs, --allreduce native, or --device cpu (or leave --device auto)"},
]

_COMM_FAILURE = re.compile(r"gloo|nccl|connection|timed? ?out|timeout|peer|socket", re.IGNORECASE)


class PeerFailure(LabkitError):
    """A collective failed: another rank died, or stalled past the collective timeout."""


class DDPStrategy(DataParallelPreset):
    """``--strategy ddp``: a preset of ``--mesh dp=N`` (replicas; the dp dimension wraps the model in PyTorch's
    DistributedDataParallel under ``--allreduce ddp``, else averages the gradients after backward with labkit's
    bucketed all-reduce), over every rank of the job.

    Options (``labkit train`` flags): ``allreduce`` (``ddp`` | ``native`` | ring, tree, ...),
    ``bucket_mb``, ``global_batch_size``, ``kill_rank_at`` (fault injection, ``RANK:STEP``).
    Checkpoints: the replicas are identical, so rank 0 alone writes ``checkpoint.pt``.
    """

    name = "ddp"
    replicated = True

    def __init__(self, env: DistEnv, options: dict | None = None):
        super().__init__(env, options)
        self.global_batch_size = self.options.get("global_batch_size")
        world = env.world_size
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ConfigError(f"--global-batch-size must be > 0, got {self.global_batch_size}")
        if self.global_batch_size is not None and self.global_batch_size % world:
            lower = max(world, self.global_batch_size // world * world)
            raise ConfigError(f"--global-batch-size {self.global_batch_size} cannot be split evenly over {world} "
                              f"ranks; use a multiple of {world} (e.g. {lower} or {lower + world}), or give "
                              "--batch-size per rank instead")
        self.kill_at = parse_kill_at(self.options.get("kill_rank_at"))
        self.step = 0

    def per_rank_batch_size(self, batch_size: int) -> int:
        """The per-rank batch: ``--global-batch-size / world_size`` if given, else ``--batch-size``."""
        return batch_size if self.global_batch_size is None else self.global_batch_size // self.env.world_size

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        self._maybe_fail()
        with self._peer_errors("the gradient all-reduce in backward"):
            return super().forward_backward(model, x, y, criterion)  # DDP all-reduces the buckets in backward

    def sync_gradients(self, model: nn.Module) -> None:
        with self._peer_errors(f"the {self.allreduce} all-reduce of the gradients"):
            super().sync_gradients(model)
        self.step += 1

    def _maybe_fail(self) -> None:
        if self.kill_at is None or self.kill_at != (self.env.rank, self.step):
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return  # only the first attempt fails, so the restarted job can finish
        print(f"rank {self.env.rank}: --kill-rank-at: SIGKILL before step {self.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def _peer_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:
            if not self.env.distributed or not (isinstance(exc, dist.DistError) or _COMM_FAILURE.search(str(exc))):
                raise
            cause = str(exc).strip().splitlines()[0][:300]
            raise PeerFailure(f"rank {self.env.rank}: {what} failed at step {self.step}: another rank died or "
                              "stalled longer than --timeout-s. Read that rank's log; continue from the last "
                              f"checkpoint with --resume (torchrun --max-restarts N does it for you). [{cause}]"
                              ) from None


def parse_kill_at(spec: str | None) -> tuple[int, int] | None:
    """``"1:6"`` -> ``(1, 6)`` (rank, step); ``None`` -> ``None``."""
    if spec is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(spec))
    if not match:
        raise ConfigError(f"--kill-rank-at {spec!r} is not RANK:STEP; e.g. --kill-rank-at 1:6")
    return int(match[1]), int(match[2])


def check_against_ddp(env: DistEnv, average: Callable[[nn.Module], None] | str, seed: int = 0) -> float:
    """Largest difference between gradients averaged by ``average`` and by DistributedDataParallel.

    Run on every rank (``labkit.dist.testing.run_ranks(check_against_ddp, 2, my_average)``). Each rank trains a
    small MLP on its own random batch; ``average(model)`` must leave the mean gradient in ``p.grad``
    (a function defined in a module, so the ranks can import it, or an ``--allreduce`` algorithm name).

    Returns:
        max |g_hand - g_ddp| over all parameters on this rank (float32 rounding: ~1e-7).
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10)).to(env.device)
    ddp = DistributedDataParallel(copy.deepcopy(model),
                                  device_ids=[env.device.index] if env.device.type == "cuda" else None)
    generator = torch.Generator().manual_seed(seed + 1 + env.rank)  # each rank its own shard
    x = torch.randn(16, 20, generator=generator).to(env.device)  # (B, 20)
    y = torch.randint(0, 10, (16,), generator=generator).to(env.device)  # (B,)
    nn.functional.cross_entropy(model(x), y).backward()
    if isinstance(average, str):
        average_gradients(model.parameters(), average)
    else:
        average(model)
    nn.functional.cross_entropy(ddp(x), y).backward()
    pairs = zip(model.parameters(), ddp.module.parameters(), strict=True)
    return max((p.grad - q.grad).abs().max().item() for p, q in pairs)


def price_ddp(plan, prof, topo) -> Estimate:
    """Data parallel over ``p`` ranks, each ``b = B/p`` samples:

    ``compute = s·T_all(b)``; ``communication = Σ_buckets AR(bucket, algo, p)`` after backward (no overlap
    is assumed: small models fit one or two buckets, ready only near the end of backward) ``+ BC(1, n_buf)``
    under PyTorch's DDP, which broadcasts the model's buffers (``n_buf`` bytes, coalesced) from rank 0 in
    every forward; memory ``3P + M_all(b) + P`` (the flat gradient bucket).
    """
    p, b = plan.processes, plan.batch_size / plan.processes
    algo = plan.option.get("allreduce", "ddp")
    count, nbytes = prof.buffers
    sync = broadcast_time(1, nbytes, p, topo) if algo == "ddp" and count else 0.0
    time = {"compute": compute_scale(topo, p, prof) * prof.time(b),
            "communication": bucketed_allreduce(prof.param_bytes, p, algo, topo) + sync,
            **common_terms(prof, topo, prof.param_bytes, b)}
    return Estimate(plan, time, memory_terms(prof, topo, prof.param_bytes, prof.saved_bytes(b), prof.param_bytes))

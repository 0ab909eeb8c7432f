"""Process-group set-up and tear-down, the same under torchrun, SLURM or a single process.

Launch one training on:

* 1 CPU/GPU:       ``labkit train ...``
* 1 node, N ranks: ``torchrun --nproc_per_node N -m labkit train --strategy ddp ...``
* N nodes (SLURM): ``srun torchrun --nnodes $SLURM_NNODES --nproc_per_node G --rdzv-backend c10d
  --rdzv-endpoint HOST:29500 -m labkit train ...`` or ``srun python -m labkit train ...`` with one
  task per GPU (the SLURM variables are read when torchrun's are absent).

Everything goes through one context manager::

    with distributed(device="auto", seed=0) as env:
        print0(f"rank {env.rank} of {env.world_size} on {env.device}")

The rank layout and device choice it starts from live in :mod:`labkit.dist.launch_info`.
"""
from __future__ import annotations

import datetime
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from labkit.dist.launch_info import (
    MULTI_RANK_GPU,
    MULTI_RANK_GPU_NCCL,
    check_gpu_per_rank,
    first_host,
    launch_info,
    resolve_device,
)
from labkit.errors import ConfigError, DeviceError


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0 .. world_size-1.
        local_rank: rank on this node (selects the GPU).
        world_size: number of processes in the job.
        local_world_size: processes on this node.
        backend: ``"nccl"``, ``"gloo"``, or ``None`` for a single process without a group.
        device: the device this rank computes on.
        distributed: whether a process group is initialised.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def seed_everything(seed: int) -> None:
    """Seed Python, torch (CPU and all GPUs)."""
    random.seed(seed)
    torch.manual_seed(seed)


def deterministic_kernels() -> None:
    """Make GPU runs repeatable (``--deterministic``): cuDNN and cuBLAS pick their deterministic algorithms (cuBLAS
    needs a fixed workspace, set before its first matrix product) and an operation without one warns. CPU kernels
    already are; some GPU kernels (atomic adds in convolution backward) otherwise differ from run to run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only (or when no process group is set up)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def _cpu_threads(local_world_size: int) -> None:
    # Several ranks on one CPU node each default to all cores: split them instead, unless the user chose.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


#: the refusal every run shares, whatever it computes
NCCL_ON_CPU = "backend nccl needs GPUs but the device is cpu; use --backend gloo on CPU nodes"


@contextmanager
def distributed(device: str = "auto", backend: str | None = None, seed: int | None = 0,
                timeout_s: float = 1800.0, environ: Mapping[str, str] | None = None,
                refusal: Callable[[str, str], str | None] | None = None) -> Iterator[DistEnv]:
    """Set up the process group (if launched as several ranks), yield a :class:`DistEnv`, always tear down.

    Args:
        device: ``"auto"`` (GPU if present), ``"cpu"`` or ``"cuda"``.
        backend: ``"nccl"`` or ``"gloo"``; default nccl on CUDA, gloo on CPU.
        seed: seeds every rank with the same value (identical initial weights); ``None`` skips seeding.
        timeout_s: collective timeout; a dead peer makes the others fail after this long, not hang.
        environ: variables to read instead of ``os.environ`` (tests).
        refusal: ``refusal(backend, device_type)``: why the run's messages cannot travel that way (one line), or
            None; a refused pair raises :class:`DeviceError` before the group starts (``labkit train`` passes its
            strategy's rows of :mod:`labkit.strategies.backends`; this layer reads no strategy).
    """
    environ = os.environ if environ is None else environ
    info = launch_info(environ)
    local_rank = info["local_rank"] if info else 0
    if backend not in (None, "nccl", "gloo"):
        raise ConfigError(f"unknown backend {backend!r}; use nccl (GPUs) or gloo (CPU)")
    dev = resolve_device(device, local_rank)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type == "cpu":
        raise DeviceError(NCCL_ON_CPU)
    if refusal is not None and (why := refusal(backend, dev.type)) is not None:
        raise DeviceError(why)
    if info is not None and str(device) in ("auto", "cuda"):  # a GPU picked by local rank
        check_gpu_per_rank(backend, dev, info["local_world_size"], environ)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if seed is not None:
        seed_everything(seed)
    if info is None:
        yield DistEnv(device=dev)
        return

    if dev.type == "cpu":
        _cpu_threads(info["local_world_size"])
    os.environ.setdefault("MASTER_ADDR", info["master_addr"])
    os.environ.setdefault("MASTER_PORT", str(info["master_port"]))
    dist.init_process_group(
        backend=backend, rank=info["rank"], world_size=info["world_size"],
        timeout=datetime.timedelta(seconds=timeout_s),
        # NCCL binds its communicator to this GPU up front; gloo binds nothing (a gloo group given a device_id makes
        # DeviceMesh split it, which deep-copies gloo's options and fails: "cannot pickle ... _Options")
        device_id=dev if dev.type == "cuda" and backend == "nccl" else None,
    )
    env = DistEnv(rank=info["rank"], local_rank=local_rank, world_size=info["world_size"],
                  local_world_size=info["local_world_size"], backend=backend, device=dev, distributed=True)
    ok = False
    try:
        yield env
        ok = True
    finally:
        if ok:
            # Gloo aborts a fraction of runs if a rank destroys the group while a peer still talks.
            dist.barrier()
        dist.destroy_process_group()


# ----- collectives on the rank's communication device ---------------------------------------------------------
# Every collective in labkit (the hand-written algorithms of labkit.collectives and the strategies' own
# point-to-point protocols aside) goes through these: NCCL reduces CUDA tensors only, gloo's CPU path takes every
# operation, so a tensor is moved to comm_device() for the call and the result copied back into it.
# tests/test_comm_device.py fails on a bare torch.distributed collective anywhere else in labkit/.


def comm_device(group=None) -> torch.device:
    """Where ``group``'s backend takes tensors: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _restore(tensor: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """``dist.all_reduce`` in place, on the communication device; returns ``tensor``."""
    moved = _moved(tensor, comm_device(group))
    dist.all_reduce(moved, op=op, group=group)
    return _restore(tensor, moved)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``dist.broadcast`` in place from global rank ``src``, on the communication device; returns ``tensor``."""
    moved = _moved(tensor, comm_device(group))
    dist.broadcast(moved, src=src, group=group)
    return _restore(tensor, moved)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """``dist.all_gather`` into ``outputs`` (one tensor per rank), on the communication device."""
    device = comm_device(group)
    moved = [_moved(t, device) for t in outputs]
    dist.all_gather(moved, _moved(tensor, device), group=group)
    return [_restore(t, m) for t, m in zip(outputs, moved)]


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, group=None) -> None:
    """``dist.gather`` of ``tensor`` into ``gather_list`` on rank ``dst`` (``None`` elsewhere)."""
    device = comm_device(group)
    moved = None if gather_list is None else [_moved(t, device) for t in gather_list]
    dist.gather(_moved(tensor, device), moved, dst=dst, group=group)
    for t, m in zip(gather_list or [], moved or []):
        _restore(t, m)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, group=None) -> torch.Tensor:
    """``dist.scatter`` of rank ``src``'s ``scatter_list`` into every rank's ``tensor``."""
    device = comm_device(group)
    moved = _moved(tensor, device)
    parts = None if scatter_list is None else [_moved(t, device) for t in scatter_list]
    dist.scatter(moved, parts, src=src, group=group)
    return _restore(tensor, moved)


def all_gather_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated into ``output``, in rank order (:func:`all_gather_into_tensor`), on the
    communication device; returns ``output``."""
    device = comm_device(group)
    moved = _moved(output, device)
    all_gather_into_tensor(moved, _moved(tensor, device), group=group)
    return _restore(output, moved)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None) -> torch.Tensor:
    """``dist.all_to_all_single``: rank i's j-th slice of ``tensor`` (``input_split_sizes[j]`` rows) becomes rank
    j's i-th slice of ``output``; ``None``: equal slices. On the communication device; returns ``output``."""
    device = comm_device(group)
    moved = _moved(output, device)
    dist.all_to_all_single(moved, _moved(tensor, device), output_split_sizes, input_split_sizes, group=group)
    return _restore(output, moved)


# ----- the single-tensor all-gather and reduce-scatter, under the name this torch gives them --------------------
# torch 2.13 renamed dist.all_gather_into_tensor and dist.reduce_scatter_tensor (names every torch from 2.0 on
# has) to all_gather_single and reduce_scatter_single, and deprecated the old names: they still work up to 2.15 but
# warn (FutureWarning) at every call site. The two functions below are the one place that picks the name, so the
# kit runs from torch 2.6 up without an AttributeError or a warning; the collective is the same either way.

#: the torch.distributed function labkit's single-tensor all-gather calls on this torch
ALL_GATHER_TENSOR = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
#: the torch.distributed function labkit's single-tensor reduce-scatter calls on this torch
REDUCE_SCATTER_TENSOR = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_into_tensor`` (``dist.all_gather_single`` from torch 2.13 on): every rank's ``tensor``
    concatenated into ``output`` (``world`` × its size), in rank order. The tensors are handed over as they are: the
    caller keeps them on :func:`comm_device`. Returns the work handle with ``async_op``, else None."""
    gather = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """``dist.reduce_scatter_tensor`` (``dist.reduce_scatter_single`` from torch 2.13 on): ``tensor`` (``world``
    equal blocks along dim 0) reduced over the ranks, block ``r`` into rank r's ``output``. The tensors are handed
    over as they are: the caller keeps them on :func:`comm_device`. Returns the work handle with ``async_op``."""
    scatter = dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single") else dist.reduce_scatter_tensor
    return scatter(output, tensor, op=op, group=group, async_op=async_op)

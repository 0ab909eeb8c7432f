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
"""
from __future__ import annotations

import datetime
import os
import random
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from labkit.backends import ANY, auto_device
from labkit.backends import check as check_backend
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


def first_host(nodelist: str) -> str:
    """First host name of a SLURM node list, e.g. ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ConfigError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_info(environ: Mapping[str, str] = os.environ) -> dict | None:
    """Rank layout from torchrun's variables, else SLURM's, else ``None`` (one plain process)."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world_size = int(environ["WORLD_SIZE"])
        return dict(
            rank=int(environ["RANK"]),
            world_size=world_size,
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=environ.get("MASTER_PORT", "29500"),
        )
    if int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ:
        tasks_per_node = environ.get("SLURM_NTASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", "1"))
        return dict(
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", 0)),
            local_world_size=int(re.match(r"\d+", tasks_per_node).group()),
            master_addr=environ.get("MASTER_ADDR") or first_host(environ.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=environ.get("MASTER_PORT", "29500"),
        )
    return None


def resolve_device(device: str | torch.device = "auto", local_rank: int = 0) -> torch.device:
    """Turn ``"auto" | "cpu" | "cuda"`` into this rank's device; ``cuda`` without a GPU is an error."""
    kind = str(device)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device} was asked for but this machine has no usable GPU "
                              "(torch.cuda.is_available() is False); use --device cpu or run on a GPU node")
        if kind == "cuda":
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device(kind)
    if kind != "cpu":
        raise ConfigError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device("cpu")


#: set to 1 where the installed NCCL lets several ranks share one GPU (newer releases); else NCCL stops them
MULTI_RANK_GPU = "NCCL_MULTI_RANK_GPU_ENABLE"
#: the first NCCL release that honours MULTI_RANK_GPU; older ones stop shared ranks with "Duplicate GPU detected"
MULTI_RANK_GPU_NCCL = (2, 30)


def check_gpu_per_rank(backend: str, device: torch.device, local_world_size: int,
                       environ: Mapping[str, str] = os.environ, nccl_version: tuple | None = None) -> None:
    """NCCL gives each rank its own GPU: more ranks on a node than visible GPUs would put two ranks on one GPU
    (``local_rank % device_count``), and NCCL stops them with "Duplicate GPU detected". Refuse that up front.

    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` lets them share where the installed NCCL honours it (2.30 and later);
    ``nccl_version`` (None: ``torch.cuda.nccl.version()``) is the installed one.

    Raises:
        DeviceError: nccl, GPUs chosen by local rank, and more ranks on this node than GPUs it sees, unless
            sharing is asked for and the installed NCCL supports it.
    """
    if backend != "nccl" or device.type != "cuda":
        return
    count = torch.cuda.device_count()
    if local_world_size > count and environ.get(MULTI_RANK_GPU) == "1":
        installed = tuple(nccl_version or torch.cuda.nccl.version())
        if installed < MULTI_RANK_GPU_NCCL:
            raise DeviceError(f"{MULTI_RANK_GPU}=1 is set, but the installed NCCL {'.'.join(map(str, installed))} "
                              f"lets ranks share a GPU only from {'.'.join(map(str, MULTI_RANK_GPU_NCCL))}: start at "
                              f"most {count} rank(s) per node, or use --backend gloo")
    elif local_world_size > count:
        raise DeviceError(f"{local_world_size} ranks on this node but {count} GPU(s) visible: NCCL needs one GPU "
                          f"per rank; start at most {count} rank(s) per node, set {MULTI_RANK_GPU}=1 where the "
                          "installed NCCL supports sharing a GPU, or use --backend gloo (--device cpu)")


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


@contextmanager
def distributed(device: str = "auto", backend: str | None = None, seed: int | None = 0,
                timeout_s: float = 1800.0, environ: Mapping[str, str] | None = None,
                strategy: str = ANY) -> Iterator[DistEnv]:
    """Set up the process group (if launched as several ranks), yield a :class:`DistEnv`, always tear down.

    Args:
        device: ``"auto"`` (GPU if present), ``"cpu"`` or ``"cuda"``.
        backend: ``"nccl"`` or ``"gloo"``; default nccl on CUDA, gloo on CPU.
        seed: seeds every rank with the same value (identical initial weights); ``None`` skips seeding.
        timeout_s: collective timeout; a dead peer makes the others fail after this long, not hang.
        environ: variables to read instead of ``os.environ`` (tests).
        strategy: the strategy's key in :mod:`labkit.backends`' table (``labkit.backends.key``); a backend and
            device it refuses raise :class:`DeviceError` before the group starts.
    """
    environ = os.environ if environ is None else environ
    info = launch_info(environ)
    local_rank = info["local_rank"] if info else 0
    if backend not in (None, "nccl", "gloo"):
        raise ConfigError(f"unknown backend {backend!r}; use nccl (GPUs) or gloo (CPU)")
    dev = resolve_device(auto_device(strategy, backend, device), local_rank)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    check_backend(strategy, backend, dev.type)
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


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``dist.all_gather_single``: every rank's ``tensor`` concatenated into ``output``, in rank order."""
    device = comm_device(group)
    moved = _moved(output, device)
    dist.all_gather_single(moved, _moved(tensor, device), group=group)
    return _restore(output, moved)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None) -> torch.Tensor:
    """``dist.all_to_all_single``: rank i's j-th slice of ``tensor`` (``input_split_sizes[j]`` rows) becomes rank
    j's i-th slice of ``output``; ``None``: equal slices. On the communication device; returns ``output``."""
    device = comm_device(group)
    moved = _moved(output, device)
    dist.all_to_all_single(moved, _moved(tensor, device), output_split_sizes, input_split_sizes, group=group)
    return _restore(output, moved)

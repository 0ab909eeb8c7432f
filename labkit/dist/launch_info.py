"""Where a rank sits and what it computes on, from what its launcher (torchrun or SLURM) and its node say.

:func:`labkit.dist.group.distributed` uses it to set up a rank.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

import torch

from labkit.errors import ConfigError, DeviceError


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

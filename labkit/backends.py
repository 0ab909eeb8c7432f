"""Which backend can carry which strategy's messages on which device: one table, checked before any work.

NCCL moves CUDA tensors only and pairs every send with a receive the peer posts in the same order; gloo runs
every operation on CPU tensors but only some on CUDA tensors (not send/recv, not the flat all-gather and
reduce-scatter). So:

=====================  ===========  ==========  ====================================================
strategy               backend      device      verdict
=====================  ===========  ==========  ====================================================
any                    nccl         cpu         refused: NCCL has no CPU path
ps, --ps-mode async    nccl         any         refused: a server receives from whichever worker
or ssp                                          pushes first, which NCCL cannot post
ps, --ps-mode async    gloo         cuda        refused; ``--device auto`` picks the CPU
or ssp
zero                   gloo         cuda        refused; ``--device auto`` picks the CPU
ddp, --allreduce ring  gloo         cuda        refused (labkit's schedules send point to point);
or another schedule                             ``--device auto`` picks the CPU
everything else        gloo         cuda        runs: labkit.dist's helpers move each collective's
                                                tensors to the CPU and back
=====================  ===========  ==========  ====================================================

:func:`labkit.dist.distributed` applies it with the strategy :func:`key` names (``labkit train`` passes it).
"""
from __future__ import annotations

from labkit.errors import DeviceError

ANY = "*"
PS_ASYNC = ("ps-async", "ps-ssp")

#: (strategy keys, backend, device type, why the combination cannot run and what to use instead)
REFUSED: list[tuple[tuple[str, ...] | str, str, str, str]] = [
    (ANY, "nccl", "cpu", "backend nccl needs GPUs but the device is cpu; use --backend gloo on CPU nodes"),
    (PS_ASYNC, "nccl", ANY, "--ps-mode {mode} receives pushes from any worker, which NCCL cannot do; "
                            "use --backend gloo (CPU tensors) or --ps-mode sync"),
    (PS_ASYNC, "gloo", "cuda", "--ps-mode {mode} sends and receives point to point, which gloo does on CPU "
                               "tensors only; use --device cpu (or leave --device auto), or --ps-mode sync"),
    (("zero",), "gloo", "cuda", "--strategy zero's all-gathers and reduce-scatters run on CPU tensors only under "
                                "gloo; use --backend nccl on GPUs, or --device cpu (or leave --device auto)"),
    (("ddp-schedule",), "gloo", "cuda", "labkit's --allreduce schedules send and receive point to point, which gloo "
                                        "does on CPU tensors only; use --backend nccl on GPUs, --allreduce native, "
                                        "or --device cpu (or leave --device auto)"),
]


def key(strategy: str, options: dict | None = None) -> str:
    """The table's name for ``strategy`` with these options: ``ps`` by its mode (``ps-sync``, ``ps-async``,
    ``ps-ssp``), ``ddp`` with one of labkit's all-reduce schedules ``ddp-schedule``."""
    options = options or {}
    if strategy == "ps":
        return f"ps-{options.get('ps_mode') or 'sync'}"
    if strategy == "ddp" and (options.get("allreduce") or "ddp") not in ("ddp", "native"):
        return "ddp-schedule"
    return strategy


def refusal(strategy_key: str, backend: str, device_type: str) -> str | None:
    """Why ``strategy_key`` cannot run on ``backend`` with ``device_type`` tensors (one line), or None."""
    for strategies, b, d, why in REFUSED:
        if (strategies == ANY or strategy_key in strategies) and b == backend and d in (ANY, device_type):
            return why.format(mode=strategy_key.split("-", 1)[-1])
    return None


def check(strategy_key: str, backend: str, device_type: str) -> None:
    """Raise :class:`DeviceError` where the table refuses the combination."""
    why = refusal(strategy_key, backend, device_type)
    if why is not None:
        raise DeviceError(why)


def auto_device(strategy_key: str, backend: str | None, device: str) -> str:
    """``--device auto`` with ``--backend gloo``, for a strategy gloo cannot run on CUDA tensors, is the CPU."""
    if str(device) == "auto" and backend == "gloo" and refusal(strategy_key, "gloo", "cuda"):
        return "cpu"
    return str(device)

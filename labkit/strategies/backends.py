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
ps (every mode)        gloo         cuda        refused (it sends point to point); ``--device auto`` picks
                                                the CPU
zero                   gloo         cuda        refused; ``--device auto`` picks the CPU
ddp, --allreduce ring  gloo         cuda        refused (labkit's schedules send point to point);
or another schedule                             ``--device auto`` picks the CPU
pipeline; mesh with    gloo         cuda        refused (the stages send activations point to point);
pp > 1                                          ``--device auto`` picks the CPU
everything else        gloo         cuda        runs: labkit.dist.group's helpers move each collective's
                                                tensors to the CPU and back
=====================  ===========  ==========  ====================================================

The rows of a strategy live in its own module, beside its ``FLAGS``: a ``BACKENDS`` literal (read without
importing the module, :func:`labkit.strategies.strategy_literal`), one dict per refusal::

    BACKENDS = [{"when": {"ps_mode": ["async", "ssp"]}, "backend": "nccl", "device": "*", "why": "..."}]

``when`` (the option's value is one of those) and ``unless`` (it is none of those) test the strategy's options,
its flags' defaults filled in, and ``dims`` its ``--mesh`` (one of those dimensions is larger than 1); ``device``
is ``cpu``, ``cuda`` or ``*``; ``why`` is the one line the user sees, formatted with the options (``{ps_mode}``).
Only the first row above, NCCL on a CPU, is this module's own.

:func:`labkit.dist.group.distributed` applies it through the ``refusal`` ``labkit train`` hands it
(:func:`refusal_of` the strategy :func:`key` names), and :func:`auto_device` picks the device it is given.
"""
from __future__ import annotations

import functools
from typing import Callable

from labkit.dist.group import NCCL_ON_CPU
from labkit.errors import ConfigError, DeviceError
from labkit.flags import defaults

ANY = "*"


def _rows(strategy: str) -> list[dict]:
    from labkit.strategies import STRATEGIES, strategy_literal

    return list(strategy_literal(strategy, "BACKENDS", ())) if strategy in STRATEGIES else []


def _options_named(rows: list[dict]) -> list[str]:
    named = {o for r in rows for o in (*r.get("when", {}), *r.get("unless", {}))}
    return sorted(named | ({"mesh"} if any("dims" in r for r in rows) else set()))


def key(strategy: str, options: dict | None = None) -> str:
    """The table's name for ``strategy`` with these options: the strategy's name, followed by the options its
    ``BACKENDS`` rows test (its flags' defaults filled in), e.g. ``ps:ps_mode=async``, ``ddp:allreduce=ring``,
    ``zero``."""
    from labkit.strategies import STRATEGIES, strategy_flags

    named = _options_named(_rows(strategy))
    if not named:
        return strategy
    given = {**(defaults(strategy_flags(strategy)) if strategy in STRATEGIES else {}),
             **{k: v for k, v in (options or {}).items() if v is not None}}
    return strategy + ":" + ";".join(f"{o}={given.get(o)}" for o in named)


def _parse(strategy_key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = strategy_key.partition(":")
    return name, dict(kv.split("=", 1) for kv in rest.split(";") if kv)


def _mesh_has(spec: str | None, dims: list[str]) -> bool:
    from labkit.dist.mesh import MeshShape

    try:
        shape = MeshShape.parse(spec)
    except ConfigError:  # no mesh, or a bad one: --mesh's own check answers that
        return False
    return any(shape.get(d, 1) > 1 for d in dims)


def _applies(row: dict, options: dict[str, str]) -> bool:
    when = all(options.get(o) in map(str, values) for o, values in row.get("when", {}).items())
    unless = all(options.get(o) not in map(str, values) for o, values in row.get("unless", {}).items())
    return when and unless and ("dims" not in row or _mesh_has(options.get("mesh"), row["dims"]))


def refusal(strategy_key: str, backend: str, device_type: str) -> str | None:
    """Why ``strategy_key`` (:func:`key`; a bare strategy name takes its flags' defaults) cannot run on
    ``backend`` with ``device_type`` tensors (one line), or None."""
    if backend == "nccl" and device_type == "cpu":
        return NCCL_ON_CPU
    name, options = _parse(strategy_key)
    rows = _rows(name)
    if ":" not in strategy_key:  # a bare name: its flags' defaults
        name, options = _parse(key(name))
    for row in rows:
        if row["backend"] == backend and row["device"] in (ANY, device_type) and _applies(row, options):
            return row["why"].format(**options)
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


def refusal_of(strategy_key: str) -> Callable[[str, str], str | None]:
    """``refusal(backend, device_type)`` of ``strategy_key``, the form :func:`labkit.dist.group.distributed` takes."""
    return functools.partial(refusal, strategy_key)

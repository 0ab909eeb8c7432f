"""The options of ``--strategy ps``, checked before any work starts: mode, servers, staleness, momentum,
straggler, timeout, the record file, and the backend/device pair (one clear ``ConfigError`` each).

    read_options(env, {"ps_mode": "ssp", "ps_servers": 2, "max_staleness": 1})   # -> PSOptions
"""
from __future__ import annotations

import dataclasses
import re

from labkit.dist.group import DistEnv
from labkit.errors import ConfigError, OutputError
from labkit.results import check_writable
from labkit.strategies.backends import check as check_backend
from labkit.strategies.backends import key
from labkit.strategies.ps.server import MODES


def parse_slow_worker(spec: str | None) -> tuple[int, float] | None:
    """``"2:4"`` -> ``(2, 4.0)``: rank 2 takes 4 times as long per step."""
    if spec is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*([0-9.]+)\s*", str(spec))
    if not match or float(match[2]) < 1:
        raise ConfigError(f"--ps-slow-worker {spec!r} is not RANK:FACTOR with FACTOR >= 1; e.g. 2:4")
    return int(match[1]), float(match[2])


@dataclasses.dataclass(frozen=True)
class PSOptions:
    """The checked options: ``workers`` are ranks ``num_servers .. world-1``; ``momentum`` None: derived."""

    mode: str
    num_servers: int
    max_staleness: int
    momentum: float | None
    timeout_s: float
    slow: tuple[int, float] | None
    workers: list[int]


def read_options(env: DistEnv, options: dict) -> PSOptions:
    """Check ``options`` for ``env``'s ranks (module docstring); raise ConfigError/OutputError on bad input."""
    mode = options.get("ps_mode") or "sync"
    if mode not in MODES:
        raise ConfigError(f"unknown --ps-mode {mode!r}; choose one of: {', '.join(MODES)}")
    num_servers = options.get("ps_servers") or 1
    staleness = options.get("max_staleness")
    if staleness is not None and mode != "ssp":
        raise ConfigError(f"--max-staleness applies to --ps-mode ssp, not {mode}")
    max_staleness = 2 if staleness is None else staleness
    momentum = options.get("ps_momentum")
    if momentum is not None and (mode == "sync" or not 0 <= momentum < 1):
        raise ConfigError(f"--ps-momentum {momentum:g}: it applies to --ps-mode async or ssp, in [0, 1); "
                          "sync mode uses --momentum")
    if max_staleness < 0:
        raise ConfigError(f"--max-staleness must be >= 0, got {max_staleness}")
    if env.world_size < num_servers + 1 or num_servers < 1:
        raise ConfigError(f"--strategy ps with --ps-servers {num_servers} needs at least "
                          f"{num_servers + 1} ranks (servers + one worker), got {env.world_size}")
    timeout_s = float(options.get("ps_timeout_s") or 300.0)
    slow = parse_slow_worker(options.get("ps_slow_worker"))
    workers = list(range(num_servers, env.world_size))
    if slow is not None and slow[0] not in workers:
        raise ConfigError(f"--ps-slow-worker rank {slow[0]} is not a worker; workers are ranks "
                          f"{workers[0]}..{workers[-1]}")
    if env.backend is not None:  # labkit train checked this already; a strategy built by hand is checked here
        check_backend(key("ps", options), env.backend, env.device.type)
    if options.get("ps_record"):  # written after training: an unwritable path fails now instead
        try:
            check_writable(options["ps_record"])
        except OutputError as exc:
            raise OutputError(f"--ps-record {options['ps_record']}: {str(exc).split('; ')[0]}; "
                              "choose a writable file") from None
    return PSOptions(mode, num_servers, max_staleness, momentum, timeout_s, slow, workers)

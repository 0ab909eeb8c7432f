"""Names of the all-reduce algorithms and the one function that builds a schedule by name."""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

from labkit.collectives.algorithms import all_to_all, master_worker, ring, round_robin, tree
from labkit.collectives.butterfly import butterfly, rabenseifner
from labkit.collectives.parameter_server import parameter_server
from labkit.collectives.schedule import Schedule, ScheduleError

GENERATORS: dict[str, Callable[[int], Schedule]] = {
    "ring": ring,
    "tree": tree,
    "butterfly": butterfly,
    "rabenseifner": rabenseifner,
    "master-worker": master_worker,
    "all-to-all": all_to_all,
    "round-robin": round_robin,
}
#: The decentralised all-reduce algorithms (every rank ends with the sum of all ranks).
ALGORITHMS: tuple[str, ...] = tuple(GENERATORS)
#: Everything that can be simulated, animated and priced: the algorithms plus the parameter server
#: (rank 0 is the server, the other ranks are workers).
SCHEDULES: tuple[str, ...] = ALGORITHMS + ("parameter-server",)


def parse_algorithms(spec: str, allowed: tuple[str, ...] = ALGORITHMS) -> list[str]:
    """``"all"`` or a comma list such as ``"ring,tree"`` -> names; unknown names raise ScheduleError."""
    names = list(allowed) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        if name not in allowed:
            raise ScheduleError(f"unknown all-reduce algorithm {name!r}; choose from {', '.join(allowed)} or 'all'")
    if not names:
        raise ScheduleError("no algorithm given; use e.g. --algo ring or --algo all")
    return names


@lru_cache(maxsize=256)
def get_schedule(name: str, world_size: int) -> Schedule:
    """The validated schedule of algorithm ``name`` for ``world_size`` ranks (cached: schedules are immutable)."""
    if name == "parameter-server":
        return parameter_server(world_size).validate()
    if name not in GENERATORS:
        raise ScheduleError(f"unknown all-reduce algorithm {name!r}; choose from {', '.join(SCHEDULES)}")
    return GENERATORS[name](world_size).validate()

"""``--mesh dp=2,tp=2``: the ranks of a job laid out on a named grid, one axis per kind of parallelism.

    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --model gpt-tiny --dataset text-sample

The grid is a :class:`torch.distributed.device_mesh.DeviceMesh` with its dimensions always in the order
:data:`MESH_ORDER` = ``("pp", "dp", "ep", "cp", "tp")``, sizes of 1 included, so ``mesh["tp"]`` and
``mesh.get_group("tp")`` exist whatever the user named. Rank ``r`` sits at the row-major coordinate of ``r``
in that shape, so the *last* dimension changes fastest: the ``tp`` ranks of one group are neighbours
(``0,1`` / ``2,3`` for ``dp=2,tp=2``) and land on one node, where tensor parallelism's per-layer collectives
find the fastest links; ``pp``, which sends one activation per micro-batch, spans the nodes.

Parsing and checking import no torch, so a bad ``--mesh`` answers at once with one line.
"""
from __future__ import annotations

import math
import re

from labkit.errors import ConfigError

#: mesh dimensions, outermost first (tp innermost: its ranks are neighbours)
MESH_ORDER: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")

_ITEM = re.compile(r"\s*([A-Za-z]\w*)\s*=\s*(-?\d+)\s*")


def parse_mesh(spec: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}`` in the order written.

    Raises:
        ConfigError: not ``name=size,...``, an unknown or repeated name, or a size below 1.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("--mesh needs name=size pairs, e.g. --mesh dp=2,tp=2")
    shape: dict[str, int] = {}
    for item in spec.split(","):
        match = _ITEM.fullmatch(item)
        if not match:
            raise ConfigError(f"--mesh {spec!r}: {item.strip()!r} is not name=size; write e.g. --mesh dp=2,tp=2")
        name, size = match[1], int(match[2])
        if name not in MESH_ORDER:
            raise ConfigError(f"--mesh {spec!r}: unknown dimension {name!r}; choose from {', '.join(MESH_ORDER)}")
        if name in shape:
            raise ConfigError(f"--mesh {spec!r}: {name} is given twice")
        if size < 1:
            raise ConfigError(f"--mesh {spec!r}: {name} must be >= 1, got {size}")
        shape[name] = size
    return shape


def full_shape(shape: dict[str, int]) -> dict[str, int]:
    """Every dimension of :data:`MESH_ORDER` in that order, the ones not named with size 1."""
    return {name: int(shape.get(name, 1)) for name in MESH_ORDER}


def check_world(shape: dict[str, int], world_size: int, spec: str | None = None) -> None:
    """The product of the sizes must be the number of ranks.

    Raises:
        ConfigError: it is not (the message says both numbers).
    """
    product = math.prod(shape.values())
    if product != world_size:
        text = spec if spec is not None else format_mesh(shape)
        raise ConfigError(f"--mesh {text} has {product} ranks ({' x '.join(map(str, shape.values()))}) but the job "
                          f"has {world_size}; start {product} ranks (torchrun --nproc_per_node {product}) or change "
                          "--mesh")


def format_mesh(shape: dict[str, int]) -> str:
    """``{"dp": 2, "tp": 2, "pp": 1}`` -> ``"dp=2,tp=2"`` (sizes of 1 left out, mesh order; ``"dp=1"`` if all 1)."""
    named = [f"{n}={shape[n]}" for n in MESH_ORDER if shape.get(n, 1) > 1]
    return ",".join(named) or "dp=1"


def build_mesh(shape: dict[str, int], device_type: str = "cpu"):
    """The :class:`~torch.distributed.device_mesh.DeviceMesh` of ``shape`` over the initialised process group,
    all of :data:`MESH_ORDER` as named dimensions (sizes of 1 included)."""
    from torch.distributed.device_mesh import init_device_mesh

    full = full_shape(shape)
    return init_device_mesh(device_type, tuple(full.values()), mesh_dim_names=tuple(full))


class MeshPlace:
    """What a mesh dimension reads of its :class:`~torch.distributed.device_mesh.DeviceMesh` when it is made (the
    names, the sizes, this rank's coordinates), for a process without a process group: a strategy's options and
    model are checked, and a stage cut, before any communication. Its groups are None (the world's)."""

    def __init__(self, shape: dict[str, int], rank: int, device_type: str = "cpu"):
        full = full_shape(shape)
        self.mesh_dim_names, self._sizes, self._coordinates = tuple(full), full, coordinates(rank, full)
        self.device_type = device_type

    def size(self, dim: int) -> int:
        return self._sizes[self.mesh_dim_names[dim]]

    def get_group(self, name: str) -> None:
        return None

    def get_local_rank(self, name: str) -> int:
        return self._coordinates[name]


def coordinates(rank: int, shape: dict[str, int]) -> dict[str, int]:
    """Where global ``rank`` sits on the mesh: ``{dim: index}`` (row-major in :data:`MESH_ORDER`)."""
    full = full_shape(shape)
    coords: dict[str, int] = {}
    for name in reversed(MESH_ORDER):
        rank, coords[name] = divmod(rank, full[name])
    return {name: coords[name] for name in MESH_ORDER}

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

import functools
import math
import re

from labkit.errors import ConfigError

#: mesh dimensions, outermost first (tp innermost: its ranks are neighbours)
MESH_ORDER: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")

_ITEM = re.compile(r"\s*([A-Za-z]\w*)\s*=\s*(-?\d+)\s*")


class MeshShape(dict):
    """``--mesh``, parsed once (:meth:`parse`): every dimension of :data:`MESH_ORDER` with its size, in that order,
    1 where not named (a ``dict``, so every reader indexes it: ``shape["tp"]``). ``str(shape)`` is its canonical
    spelling, ``dp=2,tp=2`` (sizes of 1 left out; ``dp=1`` if all are 1)."""

    def __init__(self, named: dict[str, int] | None = None, written: str | None = None):
        named = dict(named or {})
        super().__init__({name: int(named.get(name, 1)) for name in MESH_ORDER})
        self.named = named  # the dimensions as written, in that order (what a message quotes)
        self.written = written if written is not None else str(self)

    @classmethod
    def parse(cls, spec: str | MeshShape) -> MeshShape:
        """``"dp=2,tp=2"`` -> the shape; a shape is returned as it is, so a reader may be handed either.

        Raises:
            ConfigError: not ``name=size,...``, an unknown or repeated name, or a size below 1.
        """
        return spec if isinstance(spec, MeshShape) else _parse(spec)

    def __str__(self) -> str:
        return ",".join(f"{n}={self[n]}" for n in MESH_ORDER if self[n] > 1) or "dp=1"

    @property
    def ranks(self) -> int:
        """The number of ranks the mesh lays out: the product of the sizes."""
        return math.prod(self.values())

    def check_world(self, world_size: int) -> None:
        """The product of the sizes must be the number of ranks.

        Raises:
            ConfigError: it is not (the message says both numbers).
        """
        if self.ranks != world_size:
            sizes = " x ".join(map(str, (self.named or self).values()))
            raise ConfigError(f"--mesh {self.written} has {self.ranks} ranks ({sizes}) but the job has {world_size}; "
                              f"start {self.ranks} ranks (torchrun --nproc_per_node {self.ranks}) or change --mesh")

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits on the mesh: ``{dim: index}`` (row-major in :data:`MESH_ORDER`)."""
        coords: dict[str, int] = {}
        for name in reversed(MESH_ORDER):
            rank, coords[name] = divmod(rank, self[name])
        return {name: coords[name] for name in MESH_ORDER}


@functools.lru_cache(maxsize=64)
def _parse(spec: str) -> MeshShape:
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
    return MeshShape(shape, spec)


def build_mesh(shape: dict[str, int], device_type: str = "cpu"):
    """The :class:`~torch.distributed.device_mesh.DeviceMesh` of ``shape`` over the initialised process group,
    all of :data:`MESH_ORDER` as named dimensions (sizes of 1 included)."""
    from torch.distributed.device_mesh import init_device_mesh

    full = MeshShape(shape)
    return init_device_mesh(device_type, tuple(full.values()), mesh_dim_names=tuple(full))


class MeshPlace:
    """What a mesh dimension reads of its :class:`~torch.distributed.device_mesh.DeviceMesh` when it is made (the
    names, the sizes, this rank's coordinates), for a process without a process group: a strategy's options and
    model are checked, and a stage cut, before any communication. Its groups are None (the world's)."""

    def __init__(self, shape: dict[str, int], rank: int, device_type: str = "cpu"):
        full = MeshShape(shape)
        self.mesh_dim_names, self._sizes, self._coordinates = tuple(full), full, full.coordinates(rank)
        self.device_type = device_type

    def size(self, dim: int) -> int:
        return self._sizes[self.mesh_dim_names[dim]]

    def get_group(self, name: str) -> None:
        return None

    def get_local_rank(self, name: str) -> int:
        return self._coordinates[name]

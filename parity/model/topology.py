"""Mesh compositions (pure): which ranks share data, which dimension FSDP shards, which
reductions a gradient goes through, in which order.

``fsdp``     1-D: FSDP shards over every rank (each rank its own data).
``hsdp``     2-D (replicate x shard): FSDP reduce-scatters over ``shard`` and all-reduces
             across ``replicate`` (each rank its own data).
``fsdp+tp``  2-D (dp x tp): the fixture's tensor-parallel plan on ``tp`` (Colwise/Rowwise
             styles), FSDP over ``dp``; ranks of one ``tp`` group see the same data.
``ep``       2-D (dp x ep): the fixture's expert-parallel modules own their experts on
             ``ep`` (replicated over ``dp``, excluded from FSDP); FSDP shards the rest over
             every rank (each rank its own data).

Ranks are laid out row-major: ``rank = outer * inner_size + inner``.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.errors import UsageError

MESHES = ("fsdp", "hsdp", "fsdp+tp", "ep")
#: The inner dimension's size of every 2-D composition (2 x 2 on 4 ranks).
INNER = 2
_DIMS = {"fsdp": ("fsdp",), "hsdp": ("replicate", "shard"), "fsdp+tp": ("dp", "tp"), "ep": ("dp", "ep")}


@dataclass(frozen=True, kw_only=True)
class Topology:
    """One composition on ``world`` ranks."""

    name: str
    world: int

    def __post_init__(self):
        if self.name not in MESHES:
            raise UsageError(f"mesh: unknown value {self.name!r}; valid: {', '.join(MESHES)}")
        if self.name != "fsdp" and (self.world < 2 * INNER or self.world % INNER):
            raise UsageError(f"mesh {self.name!r} needs ranks = {INNER} x n with n >= 2 (e.g. 4), got "
                             f"{self.world}; use mesh 'fsdp' for fewer ranks")

    @property
    def dims(self) -> tuple[str, ...]:
        return _DIMS[self.name]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.world,) if self.name == "fsdp" else (self.world // INNER, INNER)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (1: none)."""
        return INNER if self.name == "fsdp+tp" else 1

    @property
    def ep(self) -> int:
        """Expert-parallel degree (1: experts are not distributed)."""
        return INNER if self.name == "ep" else 1

    @property
    def data_world(self) -> int:
        """How many ranks see distinct data (tensor-parallel peers share theirs)."""
        return self.world // self.tp

    def data_rank(self, rank: int) -> int:
        return rank // self.tp

    def replica_groups(self) -> list[list[int]]:
        """HSDP: the data ranks of each shard group, one list per replica (the reference sums
        each group first, as the reduce-scatter does, then across replicas); otherwise one
        group of every data rank."""
        if self.name != "hsdp":
            return [list(range(self.data_world))]
        return [list(range(r * INNER, (r + 1) * INNER)) for r in range(self.world // INNER)]


def local_region(shape, mesh_shape, coordinate, placements) -> tuple[tuple[int, int], ...]:
    """Where the piece a rank at ``coordinate`` of a mesh of ``mesh_shape`` holds of a tensor of
    ``shape`` placed by ``placements`` sits in the whole, ``((offset, length), ...)`` per
    dimension: torch's own placement rule (DTensor's local shape and global offset)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local, offset = _compute_local_shape_and_global_offset(tuple(shape), tuple(mesh_shape), list(coordinate),
                                                           placements)
    return tuple(zip(offset, local))

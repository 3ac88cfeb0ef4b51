"""A unit's mesh: which group it shards over, which it replicates over, and its placements.

A 1-D mesh shards over all of it; a 2-D one (HSDP) replicates over dim 0 and shards over dim
1, as FSDP2: DBuffers are laid out for, and gathered in, the shard group.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from vescale_plugins.ragged.dtensor import every_copy_of_mesh
from vescale_plugins.ragged.placement import RaggedShard

__all__ = ["UnitMesh", "is_group_size", "post_forward_group"]


@dataclass(frozen=True)
class UnitMesh:
    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int  # ranks in the shard group (the DBuffers' world size)
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int  # ranks in the replicate group (HSDP), else 1: asked per reduction, kept here

    @classmethod
    def of(cls, mesh: DeviceMesh) -> UnitMesh:
        shard_dim = mesh.ndim - 1
        return cls(
            mesh,
            mesh.get_group(shard_dim),
            mesh.size(shard_dim),
            mesh.get_local_rank(shard_dim),
            mesh.get_group(0) if mesh.ndim == 2 else None,
            mesh.size() // mesh.size(shard_dim),
        )

    def placements(self, dims: tuple[int, ...], local_units: Sequence[int]) -> list[Placement]:
        """The DTensor placements of a parameter whose shard-group layout is ``local_units``
        of the dims ``dims`` (``BufferSlot.dims``: rows of dim 0, every dim where it is cut
        element-wise, none for a zero-size parameter)."""
        ragged = RaggedShard(dims, local_units)
        return [Replicate(), ragged] if self.replicate_group is not None else [ragged]


def is_group_size(value: Any) -> TypeGuard[int]:
    """``reshard_after_forward`` given as a number of ranks (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


# One set of k-rank groups per enumeration of ranks, shared by every unit (and every mesh over
# the same ranks) that reshards to k ranks, per world: keyed weakly by the default group, whose
# end (``destroy_process_group``) is every rank's at the same point, so every rank creates the
# same groups in the same order. Keyed by the ranks, not by the mesh object, whose id a later
# mesh over other ranks could reuse. Under a threaded process group (a thread per rank) each
# rank-thread has its own world, so its own groups.
_POST_FORWARD_GROUPS: weakref.WeakKeyDictionary[
    dist.ProcessGroup, dict[tuple[tuple[int, ...], ...], dist.ProcessGroup]
] = weakref.WeakKeyDictionary()


def post_forward_group(mesh: DeviceMesh, k: int) -> dist.ProcessGroup:
    """This rank's group of k consecutive ranks of the shard dim (every rank creates all of
    them, in the same order, at the first forward that needs them; for a submesh such as a
    tensor-parallel model's dp mesh, those of every copy of it)."""
    rows = every_copy_of_mesh(mesh).reshape(-1, mesh.size(mesh.ndim - 1)).tolist()
    enumeration = tuple(tuple(row[i : i + k]) for row in rows for i in range(0, len(row), k))
    world = dist.group.WORLD
    assert world is not None  # a unit's mesh exists only in an initialised world
    groups = _POST_FORWARD_GROUPS.setdefault(world, {})
    if enumeration not in groups:
        groups[enumeration], _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in enumeration])
    return groups[enumeration]

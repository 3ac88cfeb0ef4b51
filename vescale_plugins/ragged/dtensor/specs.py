"""What every part of the DTensor integration shares: torch's original functions, and
the checks and arithmetic of RaggedShard specs next to other placements (TP/EP shards)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from vescale_plugins.ragged.placement import RaggedShard

aten = torch.ops.aten

ORIGINAL: dict[str, Any] = {}


def has_ragged(placements: Sequence[Placement]) -> bool:
    for p in placements:  # a loop, not any(genexpr): asked of every operand of every op
        if isinstance(p, RaggedShard):
            return True
    return False


def ragged_mesh_dim(spec: DTensorSpec) -> int | None:
    for i, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            return i
    return None


def ragged_placement(placements: Sequence[Placement]) -> tuple[int, RaggedShard]:
    """The mesh dim of the (first) RaggedShard in ``placements`` and that placement, for
    placements known to hold one (callers have checked :func:`has_ragged`)."""
    for i, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            return i, p
    raise ValueError(f"placements {tuple(placements)} hold no RaggedShard")


def check_spec(placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int]) -> None:
    """Validate ragged placements against a mesh and shape; raise before any collective."""
    ragged_dims = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if len(ragged_dims) > 1:
        raise NotImplementedError(
            f"placements {tuple(placements)}: RaggedShard on more than one mesh dim is not supported"
        )
    if not ragged_dims:
        return
    i, placement = ragged_placement(placements)
    placement.check_mesh_dim_size(mesh.size(i), shape)
    _check_composition(placements, mesh, shape, i, placement)
    placement.layout(other_dims_local_shape(placements, mesh, shape))


def is_sharding(p: Placement) -> bool:
    """Each rank holds a different part on this mesh dim (so reductions over it are partial)."""
    return isinstance(p, RaggedShard) or p.is_shard()


def has_other_shards(placements: Sequence[Placement]) -> bool:
    """``Shard`` on a mesh dim (tensor or expert parallel), besides any RaggedShard."""
    return any(p.is_shard() and not isinstance(p, RaggedShard) for p in placements)


def _check_composition(
    placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int], i: int, ragged: RaggedShard
) -> None:
    """Plain ``Shard``/``Replicate`` on the other mesh dims; a later Shard that splits the
    ragged rows asks for ``StridedRaggedShard`` with its split factor (the layout names its
    order). Uneven Shards are fine: each rank's ragged layout is of its own local shape."""
    split_factor = 1
    for j, p in enumerate(placements):
        if j == i or not p.is_shard():
            continue
        if type(p) is not Shard:
            raise NotImplementedError(
                f"placements {tuple(placements)}: {p!r} next to a RaggedShard is not supported; use Shard or Replicate"
            )
        if j > i and p.dim % len(shape) < len(ragged.dims):
            split_factor *= mesh.size(j)
    strided = getattr(ragged, "split_factor", 1)
    if strided != split_factor:
        fix = (
            f"StridedRaggedShard({ragged.dims}, {ragged.local_units}, split_factor={split_factor})"
            if split_factor > 1
            else f"RaggedShard({ragged.dims}, {ragged.local_units})"
        )
        raise ValueError(
            f"placements {tuple(placements)}: the RaggedShard cuts each rank's local tensor of the "
            f"other mesh dims, whose shards split its rows {split_factor} way(s); use {fix}"
        )


def other_dims_box(
    placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offsets of this rank's local tensor under the placements other than
    the RaggedShard (torch's own chunking, uneven included): the tensor the RaggedShard cuts."""
    others = [Replicate() if isinstance(p, RaggedShard) else p for p in placements]
    if not any(p.is_shard() for p in others):
        return tuple(shape), (0,) * len(shape)
    local_shape, offsets = ORIGINAL["compute_local_shape_and_global_offset"](shape, mesh, others)
    return tuple(local_shape), tuple(offsets)


def other_dims_local_shape(placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int]) -> tuple[int, ...]:
    return other_dims_box(placements, mesh, shape)[0]


def other_dims_slice(full: torch.Tensor, placements: Sequence[Placement], mesh: DeviceMesh) -> torch.Tensor:
    """This rank's part of ``full`` under the placements other than the RaggedShard (a view)."""
    sizes, offsets = other_dims_box(placements, mesh, full.shape)
    for d, (size, offset) in enumerate(zip(sizes, offsets)):
        if size != full.shape[d]:
            full = full.narrow(d, offset, size)
    return full


def spec_like(ref: DTensorSpec, meta: TensorMeta) -> DTensorSpec:
    return DTensorSpec(ref.mesh, ref.placements, tensor_meta=meta)


def with_placements(spec: DTensorSpec, placements: Sequence[Placement]) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def call_torch_default(op: Any, args: Any, kwargs: Any) -> Any:
    # Our handler is registered for every DTensor; step aside for non-ragged calls.
    handlers = DTensor._op_dispatcher._custom_op_handlers
    ours = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = ours


def shift_offsets(offsets: Sequence[int], by: Sequence[int]) -> tuple[int, ...]:
    return tuple(o + b for o, b in zip(offsets, by))

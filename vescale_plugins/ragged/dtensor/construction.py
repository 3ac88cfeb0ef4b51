"""Building DTensors with RaggedShard placements: ``distribute_tensor``, ``DTensor.from_local``
(which must be given the global shape) and the single-box local shape/offset query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from vescale_plugins.ragged.dtensor.specs import (
    ORIGINAL,
    check_spec,
    has_ragged,
    other_dims_box,
    other_dims_local_shape,
    other_dims_slice,
    ragged_placement,
    shift_offsets,
)
from vescale_plugins.ragged.layout import flat_interval_boxes


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``torch.distributed.tensor.distribute_tensor`` that also accepts RaggedShard placements."""
    if placements is None or not has_ragged(placements) or isinstance(tensor, DTensor):
        return ORIGINAL["distribute_tensor"](tensor, device_mesh, placements, src_data_rank=src_data_rank)
    if device_mesh is None:
        raise ValueError("distribute_tensor with a RaggedShard placement needs an explicit device_mesh")
    mesh = device_mesh
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"{len(placements)} placements for a {mesh.ndim}-D mesh; give one per mesh dim")
    check_spec(placements, mesh, tensor.shape)
    if any(p.is_partial() for p in placements):
        raise ValueError(f"distribute_tensor cannot create Partial placements: {placements}")
    full = tensor.detach().to(mesh.device_type).contiguous()
    if src_data_rank is not None and mesh._is_current_rank_part_of_mesh():
        for i in range(mesh.ndim):
            torch.distributed.broadcast(full, group_src=src_data_rank, group=mesh.get_group(i))
    i, ragged = ragged_placement(placements)
    local = ragged.split_full(other_dims_slice(full, placements, mesh).contiguous(), mesh.get_local_rank(i)).clone()
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype))
    return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = False,
    shape: torch.Size | None = None,
    stride: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> DTensor:
    """``DTensor.from_local`` that validates RaggedShard placements before building the DTensor."""
    if placements is not None and has_ragged(placements):
        if shape is None or stride is None:
            raise ValueError(
                f"DTensor.from_local with {tuple(placements)} needs shape= and stride= of the global "
                "tensor: ragged shards differ in size per rank, so the global shape cannot be inferred"
            )
        mesh = device_mesh
        if mesh is None:
            raise ValueError("DTensor.from_local with a RaggedShard placement needs an explicit device_mesh")
        check_spec(tuple(placements), mesh, shape)
        i, ragged = ragged_placement(placements)
        inner = other_dims_local_shape(placements, mesh, shape)
        expected = ragged.layout(inner).slices[mesh.get_local_rank(i)].local_shape
        if tuple(local_tensor.shape) != tuple(expected):
            raise ValueError(
                f"DTensor.from_local: local tensor of shape {tuple(local_tensor.shape)} on mesh rank "
                f"{mesh.get_local_rank(i)}, but {ragged!r} of global shape {tuple(shape)} puts "
                f"a local tensor of shape {tuple(expected)} there"
            )
    return ORIGINAL["from_local"](
        local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride, **kwargs
    )


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement], skip_offset: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's local-shape-and-offset query, answered for a ragged shard that is one box.

    Row-wise shards (the runtime's) are one box of whole rows; an element-wise shard is
    generally several boxes, which this single-box API cannot describe: refuse rather than lie.
    """
    if not has_ragged(placements):
        return ORIGINAL["compute_local_shape_and_global_offset"](global_shape, mesh, placements, skip_offset)
    check_spec(tuple(placements), mesh, global_shape)
    i, ragged = ragged_placement(placements)
    inner, inner_offsets = other_dims_box(placements, mesh, global_shape)
    rank_slice = ragged.layout(inner).slices[mesh.get_local_rank(i)]
    boxes = [
        (shift_offsets(o, inner_offsets), s)
        for o, s in flat_interval_boxes(inner, rank_slice.offset, rank_slice.length)
    ]
    if len(boxes) > 1:
        raise ValueError(
            f"{ragged!r} on shape {tuple(global_shape)}: this rank's shard is {len(boxes)} boxes, "
            "not one; use a row-wise RaggedShard (dims=(0,)) where a single local box is required"
        )
    if not boxes:
        empty = (0, *inner[1:]) if len(global_shape) else (0,)
        return empty, inner_offsets
    offsets, sizes = boxes[0]
    return tuple(sizes), tuple(offsets)

"""``redistribute``, ``full_tensor`` and their backward for RaggedShard specs: torch's
``redistribute_local_tensor`` (private) is redirected here, and left to torch otherwise."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._ops._math_ops import _NormPartial

import vescale_plugins.ragged.ragged_collectives as rc
from vescale_plugins.ragged.dtensor.specs import (
    ORIGINAL,
    check_spec,
    has_other_shards,
    has_ragged,
    other_dims_local_shape,
    ragged_mesh_dim,
    ragged_placement,
    with_placements,
)
from vescale_plugins.ragged.placement import RaggedShard


def _partial_kind(p: Partial) -> str:
    if isinstance(p, _NormPartial):
        return "norm"
    return p.reduce_op


def _reduce_scatter_into_ragged(
    local: torch.Tensor, src: Partial, dst: RaggedShard, mesh: DeviceMesh, i: int
) -> torch.Tensor:
    layout = dst.layout(local.shape)
    group = mesh.get_group(i)
    if isinstance(src, _NormPartial):
        powered = local**src.norm_type
        return rc.reduce_scatter_ragged(powered, layout, group, "sum") ** (1.0 / src.norm_type)
    return rc.reduce_scatter_ragged(local, layout, group, src.reduce_op)


def _ragged_to_partial(
    local: torch.Tensor, src: RaggedShard, dst: Partial, shape: torch.Size, mesh: DeviceMesh, i: int
) -> torch.Tensor:
    kind = _partial_kind(dst)
    if kind not in ("sum", "avg"):
        raise NotImplementedError(f"redistribute from {src} to {dst} is not supported")
    scale = float(mesh.size(i)) if kind == "avg" else 1.0
    return rc.ragged_to_partial_sum(local, src.layout(shape), mesh.get_local_rank(i), scale)


def _to_full(local: torch.Tensor, src: Placement, shape: torch.Size, mesh: DeviceMesh, i: int) -> torch.Tensor:
    """Any placement on mesh dim ``i`` -> the replicated value on that dim."""
    if isinstance(src, RaggedShard):
        return rc.gather_ragged(local, src.layout(shape), mesh.get_group(i))
    if src.is_shard():
        assert isinstance(src, Shard)  # check_spec allows only Shard itself next to a RaggedShard
        return rc.gather_shard_dim(local, shape, src.dim, mesh.get_group(i))
    if src.is_partial():
        assert isinstance(src, Partial)
        return src._reduce_value(local, mesh, i)
    return local


def _transform_mesh_dim(
    local: torch.Tensor, src: Placement, dst: Placement, shape: torch.Size, mesh: DeviceMesh, i: int
) -> torch.Tensor:
    """Move ``local`` from ``src`` to ``dst`` on one mesh dim; the other dims are elementwise."""
    if src == dst or mesh.size(i) == 1 and not (isinstance(src, RaggedShard) or isinstance(dst, RaggedShard)):
        return local
    rank = mesh.get_local_rank(i)
    if isinstance(dst, RaggedShard):
        if isinstance(src, RaggedShard):
            return rc.reshard_ragged(local, src.layout(shape), dst.layout(shape), mesh.get_group(i))
        if src.is_partial():
            assert isinstance(src, Partial)
            return _reduce_scatter_into_ragged(local, src, dst, mesh, i)
        full = _to_full(local, src, shape, mesh, i)
        return dst.split_full(full.contiguous(), rank).clone()
    if isinstance(src, RaggedShard):
        if dst.is_partial():
            assert isinstance(dst, Partial)
            return _ragged_to_partial(local, src, dst, shape, mesh, i)
        full = _to_full(local, src, shape, mesh, i)
        if dst.is_shard():
            assert isinstance(dst, Shard)  # check_spec allows only Shard itself next to a RaggedShard
            return rc.split_shard_dim(full, dst.dim, rank, mesh.size(i))
        return full
    if dst.is_replicate() and src.is_partial():
        assert isinstance(src, Partial)
        return src._reduce_value(local, mesh, i)
    if dst.is_partial() and src.is_replicate():
        assert isinstance(dst, Partial)
        return dst._partition_value(local, mesh, i)
    raise NotImplementedError(f"redistribute from {src} to {dst} alongside a RaggedShard is not supported")


def _redistribute_composed(
    local: torch.Tensor, current: DTensorSpec, target: DTensorSpec, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """Redistribute where a RaggedShard sits next to Shards on other mesh dims.

    The same other-dim placements with another ragged layout: one all-to-all in the ragged
    dim's group. Otherwise in three steps: gather the ragged dim (this rank's local tensor
    of the other dims), let torch move the other dims, cut the target's ragged dim locally.
    """
    shape = current.shape
    i, j = ragged_mesh_dim(current), ragged_mesh_dim(target)
    others_same = (
        current.mesh == target.mesh
        and i == j
        and all(a == b for k, (a, b) in enumerate(zip(current.placements, target.placements)) if k != i)
    )
    if others_same:
        # i == j: both specs hold their RaggedShard on the same mesh dim.
        (i, src), (_, dst) = ragged_placement(current.placements), ragged_placement(target.placements)
        inner = other_dims_local_shape(current.placements, current.mesh, shape)
        return rc.reshard_ragged(local, src.layout(inner), dst.layout(inner), current.mesh.get_group(i))
    if i is not None:
        _, src = ragged_placement(current.placements)
        inner = other_dims_local_shape(current.placements, current.mesh, shape)
        local = rc.gather_ragged(local, src.layout(inner), current.mesh.get_group(i))
        current = with_placements(current, [Replicate() if k == i else p for k, p in enumerate(current.placements)])
    middle = (
        target
        if j is None
        else with_placements(target, [Replicate() if k == j else p for k, p in enumerate(target.placements)])
    )
    if current.placements != middle.placements or current.mesh != middle.mesh:
        local = ORIGINAL["redistribute_local_tensor"](local.contiguous(), current, middle, *args, **kwargs)
    if j is not None:
        _, dst = ragged_placement(target.placements)
        local = dst.split_full(local.contiguous(), target.mesh.get_local_rank(j)).clone()
    return local


def _redistribute_ragged(
    local: torch.Tensor, current: DTensorSpec, target: DTensorSpec, *args: Any, **kwargs: Any
) -> torch.Tensor:
    shape = current.shape
    check_spec(current.placements, current.mesh, shape)
    check_spec(target.placements, target.mesh, shape)
    if not current.mesh._is_current_rank_part_of_mesh():
        return local
    if has_other_shards(current.placements) or has_other_shards(target.placements):
        return _redistribute_composed(local, current, target, *args, **kwargs)
    # Reduce Partial dims first (elementwise on whatever the local tensor is), then move the
    # ragged dim, then create any new Partial dims: every step sees a well-defined value.
    order = sorted(
        range(current.mesh.ndim),
        key=lambda i: (not current.placements[i].is_partial(), target.placements[i].is_partial()),
    )
    for i in order:
        local = _transform_mesh_dim(local, current.placements[i], target.placements[i], shape, current.mesh, i)
    return local


def redistribute_local_tensor(
    local_tensor: torch.Tensor, current_spec: DTensorSpec, target_spec: DTensorSpec, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """Drop-in for torch's ``redistribute_local_tensor`` that handles RaggedShard specs."""
    if has_ragged(current_spec.placements) or has_ragged(target_spec.placements):
        return _redistribute_ragged(local_tensor, current_spec, target_spec, *args, **kwargs)
    return ORIGINAL["redistribute_local_tensor"](local_tensor, current_spec, target_spec, *args, **kwargs)

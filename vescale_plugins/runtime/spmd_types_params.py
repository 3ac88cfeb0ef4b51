"""Plain parameters annotated with spmd_types, as torch 2.15's FSDP2 takes them.

torchtitan's default ``spmd_backend="spmd_types"`` leaves parameters plain tensors and
annotates each with its SPMD type per mesh axis (``spmd.R`` on the data-parallel axis,
``spmd.S(d)``/``spmd.I`` on tensor-parallel ones), then calls ``fully_shard(mesh=full_mesh,
dp_mesh_dims=...)``. FSDP2 (``FSDPParam._resolve_spmd_types_for_storage``) stores such a
parameter as a DTensor on the full mesh with the placements the annotations translate to,
and from there it is an SPMD-mesh DTensor parameter like any other, except that:

- the gathered parameter the module computes with is the plain local tensor, not the DTensor
  (the annotations are put back on it when spmd_types type checking is on);
- its gradient arrives plain and is wrapped as a DTensor with the placements of the
  backward types (``R`` -> ``Partial``, ``S(d)`` -> ``Shard(d)``, ``I`` -> ``Replicate``),
  so a ``Partial`` on the data-parallel dims is what the reduce-scatter sums.

Here that translation, with FSDP2's validation and errors; ``tensor_parallel`` builds the
parameter's ParallelSpec from the DTensor it gives. Whether it applies at all (the torch
version, the package installed) is ``fsdp2_semantics.takes_spmd_typed_parameters``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from vescale_plugins.runtime.fsdp2_semantics import takes_spmd_typed_parameters

__all__ = ["SpmdTypes", "annotations_of", "storage_of"]


class SpmdMesh(Protocol):
    """What the translation reads of ``tensor_parallel.SpmdMesh``: the full mesh and its
    data-parallel (shard and replicate) dims."""

    @property
    def mesh(self) -> DeviceMesh: ...

    @property
    def shard_dims(self) -> tuple[int, ...]: ...

    @property
    def replicate_dims(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class SpmdTypes:
    """What FSDP2 keeps of a parameter's annotations: the backward types' placements for its
    gradient, and the type (with its partition spec) restored on the gathered parameter."""

    grad_placements: tuple[Placement, ...]
    restore_type: dict[Any, Any]
    partition_spec: Any

    def restore(self, tensor: torch.Tensor) -> None:
        """The annotations again on the gathered (plain) parameter, when type checking is on."""
        import spmd_types as spmd

        if self.restore_type and spmd.is_type_checking():
            spmd.assert_type(tensor, self.restore_type, partition_spec=self.partition_spec)


def annotations_of(param: torch.Tensor) -> tuple[Any, Any] | None:
    """A plain parameter's spmd_types local type and partition spec, or ``None`` where it has
    none (or the installed torch's FSDP2 would not read them)."""
    if isinstance(param, DTensor) or not takes_spmd_typed_parameters():
        return None
    import spmd_types as spmd
    from spmd_types.runtime import get_partition_spec

    local_type = spmd.get_local_type(param)
    if not local_type:
        return None
    return local_type, get_partition_spec(param)


def storage_of(
    name: str, param: torch.Tensor, annotations: tuple[Any, Any], spmd_mesh: SpmdMesh | None
) -> tuple[DTensor, SpmdTypes]:
    """The DTensor on the full mesh FSDP2 stores ``param`` as (over the same data), and what
    it keeps of the annotations; FSDP2's errors, naming the parameter ``name``."""
    import spmd_types as spmd
    from spmd_types.types import partition_spec_to_shard_types

    init_local_type, partition_spec = annotations
    storage_mesh = spmd_mesh.mesh if spmd_mesh is not None else None
    if storage_mesh is None or storage_mesh.mesh_dim_names is None:
        raise ValueError(
            "spmd_types parameters require fully_shard() to be called with both "
            "a named full DeviceMesh for FSDP storage and "
            "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...), "
            "where shard names the mesh axis or axes FSDP shards parameters "
            "across and replicate names the HSDP/DDP mesh axis or axes FSDP "
            "replicates across."
        )
    assert spmd_mesh is not None  # storage_mesh is its mesh
    storage_mesh_axes = tuple(
        (dim_name, spmd.MeshAxis.of(storage_mesh.get_group(dim_name))) for dim_name in storage_mesh.mesh_dim_names
    )
    storage_axes = tuple(axis for _, axis in storage_mesh_axes)
    local_type = dict(init_local_type)
    if partition_spec is not None:
        local_type.update(partition_spec_to_shard_types(partition_spec))
    annotated_axes = tuple(local_type.keys())

    # The typechecking mesh the parameter is annotated on.
    if _spans_same_mesh(annotated_axes, storage_axes):
        restore_mesh = annotated_axes
    elif (current_mesh := spmd.current_mesh()) is not None:
        restore_mesh = tuple(current_mesh)
    else:
        raise ValueError(
            f"Parameter '{name}' has partial "
            "spmd_types annotations that cannot be restored from its FSDP "
            "storage mesh. Fully annotate the parameter on its storage "
            "mesh, or wrap fully_shard() in spmd.set_current_mesh(...) "
            "when all parameters in the FSDP unit share one typechecking "
            "mesh. Mixed per-parameter typechecking meshes with partial "
            "annotations are not supported. "
            f"Annotated axes: {annotated_axes}. "
            f"Storage mesh axes: {storage_axes}."
        )
    unknown_axes = tuple(axis for axis in init_local_type if axis not in restore_mesh)
    if unknown_axes:
        raise ValueError(
            f"FSDP found spmd_types annotations on parameter "
            f"'{name}' and will restore runtime "
            f"annotations on compute mesh axes {restore_mesh}, but the "
            f"parameter is annotated on axes {unknown_axes} that are not in "
            "that mesh. Annotate only axes in the compute mesh."
        )
    if not _spans_same_mesh(restore_mesh, storage_axes):
        raise ValueError(
            f"Parameter '{name}' uses spmd_types "
            "annotations on a typechecking mesh that does not span the "
            "same ranks as its FSDP storage mesh. FSDP can fill omitted "
            "FSDP-managed axes only when these meshes span the same "
            f"rank set. Typechecking mesh axes: {restore_mesh}. "
            f"Storage mesh axes: {storage_axes}."
        )
    from spmd_types._mesh_axis import flatten_axes

    names = storage_mesh.mesh_dim_names
    dp_names = {names[d] for d in itertools.chain(spmd_mesh.shard_dims, spmd_mesh.replicate_dims)}
    fsdp_axis = flatten_axes(tuple(axis for dim_name, axis in storage_mesh_axes if dim_name in dp_names))
    non_fsdp_storage_mesh_axes = {axis for dim_name, axis in storage_mesh_axes if dim_name not in dp_names}
    storage_axis_types = {axis: spmd.R for dim_name, axis in storage_mesh_axes if dim_name in dp_names}
    # Annotations are either spmd.R (optional) on FSDP axes or explicit on the others.
    for axis, axis_type in local_type.items():
        if axis <= fsdp_axis:  # MeshAxis ordering: contained in the FSDP submesh
            if axis_type is not spmd.R:
                raise ValueError(
                    f"Expected spmd.R on FSDP DP axis {axis} for parameter "
                    f"'{name}' but got {axis_type}. "
                    "FSDP requires DP parameters to be R since it handles "
                    "the DP gradient reduction."
                )
        else:
            if axis not in non_fsdp_storage_mesh_axes:
                raise ValueError(
                    f"Parameter '{name}' has spmd_types "
                    f"annotation on axis {axis}, which is neither a non-FSDP "
                    "storage-mesh axis nor contained in the FSDP DP mesh."
                )
            storage_axis_types[axis] = axis_type
    if set(storage_axes) != set(storage_axis_types.keys()):
        raise ValueError(
            f"Parameter '{name}' has incomplete "
            "spmd_types annotations for FSDP storage. "
            f"Annotated axes: {tuple(local_type.keys())}. "
            f"Storage mesh axes: {storage_axes}. "
            f"FSDP mesh dims: shard={tuple(names[d] for d in spmd_mesh.shard_dims)}, "
            f"replicate={tuple(names[d] for d in spmd_mesh.replicate_dims)}. "
            "Missing non-FSDP storage axes: "
            f"{tuple(axis for _, axis in storage_mesh_axes if axis not in storage_axis_types)}."
        )

    restore_type = {axis: init_local_type.get(axis, spmd.R) for axis in restore_mesh}
    # In the storage mesh's dim order (FSDP2 relies on the dict's insertion order, which
    # starts with the data-parallel axes; here each placement goes to its own dim).
    by_axis = dict(storage_axis_types)
    placements = tuple(spmd.spmd_type_to_dtensor_placement(by_axis[axis]) for axis in storage_axes)
    grad_placements = tuple(spmd.spmd_type_to_dtensor_placement(by_axis[axis].backward_type()) for axis in storage_axes)
    # Not wrapped in a Parameter as FSDP2's: that detaches it through DTensor's sharding
    # propagation, whose cache may answer with an equal mesh made earlier, not this one.
    dtensor = DTensor.from_local(param.detach(), storage_mesh, placements, run_check=False)
    return dtensor, SpmdTypes(grad_placements, restore_type, partition_spec)


def _spans_same_mesh(lhs_axes: tuple[Any, ...], rhs_axes: tuple[Any, ...]) -> bool:
    """Whether two axis sets span the same normalized rank mesh (FSDP2's test)."""
    import spmd_types as spmd
    from spmd_types._mesh_axis import flatten_axes

    lhs_mesh = spmd.normalize_mesh(frozenset(lhs_axes))
    rhs_mesh = spmd.normalize_mesh(frozenset(rhs_axes))
    if not lhs_mesh or not rhs_mesh:
        return lhs_mesh == rhs_mesh
    return flatten_axes(tuple(lhs_mesh)) == flatten_axes(tuple(rhs_mesh))

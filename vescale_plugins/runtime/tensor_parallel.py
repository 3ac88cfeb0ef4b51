"""Parameters that are already DTensors when ``fully_shard`` sees them (TP, EP, SPMD meshes).

Two ways in, as FSDP2's:

- **tensor/expert parallel**: ``parallelize_module`` (or an EP plan) made the parameter a
  DTensor on a TP/EP mesh, and ``fully_shard(mesh=dp_mesh)`` gets a data-parallel mesh from
  the same root mesh. The sharded parameter lives on the two concatenated, ``(dp, tp)``.
- **SPMD mesh** (``dp_mesh_dims``): the parameter is a DTensor on the full mesh with
  ``Replicate()`` on the data-parallel dim(s), and ``fully_shard(mesh=full_mesh,
  dp_mesh_dims=...)`` names them (shard dims, and replicate dims for HSDP); the sharded
  parameter lives on that same mesh, or, where several shard dims are flattened into one
  (``shard=("dp_shard", "cp")``), on FSDP2's mesh with the flattened dim in their place.

Either way the unit's DBuffer holds this rank's tensor-parallel local tensor, cut by the
planner over the data-parallel ranks; the sharded parameter is a DTensor with a RaggedShard
(StridedRaggedShard where a later mesh dim shards its rows) on the data-parallel dim and
the original placements on the others; the gathered parameter is the original DTensor, so
the tensor-parallel forward runs unchanged, and its gradient arrives as a DTensor too.

A third way in, torch 2.15's: on an SPMD mesh, a plain parameter annotated with spmd_types
(torchtitan's default backend) is taken as the DTensor its annotations describe
(``spmd_types_params``); it is gathered as the plain local tensor, and its plain gradient is
read with the placements of the backward types.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from vescale_plugins.ragged.dtensor import concatenate_meshes, make_dtensor, other_dims_slice
from vescale_plugins.ragged.placement import RaggedShard, StridedRaggedShard
from vescale_plugins.runtime.spmd_types_params import SpmdTypes, annotations_of, storage_of

__all__ = ["ParallelSpec", "SpmdMesh", "parallel_spec_for", "resolve_dp_mesh_dims", "spmd_mesh_of"]


@dataclass(frozen=True)
class SpmdMesh:
    """``fully_shard(mesh=full_mesh, dp_mesh_dims=...)``: the full mesh, its data-parallel
    dims, and the data-parallel mesh FSDP2 derives from them: the shard dim(s) flattened into
    one, after the replicate dim(s) flattened into one for HSDP. Replicate dims alone (DDP)
    are HSDP over shard groups of one rank each."""

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    shard_dims: tuple[int, ...]
    replicate_dims: tuple[int, ...]


@dataclass(frozen=True)
class ParallelSpec:
    """How one parameter is distributed besides veScale-FSDP's own sharding.

    ``unsharded_*`` is the DTensor the module saw before ``fully_shard`` (what the forward
    sees again once gathered); ``sharded_mesh`` is where the sharded parameter lives, and
    ``sharded_template`` its placements with ``None`` on the dim the RaggedShard goes on
    (none for DDP on an SPMD mesh: the parameter stays replicated, as the module gave it).
    """

    unsharded_mesh: DeviceMesh
    unsharded_placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    sharded_mesh: DeviceMesh
    sharded_template: tuple[Placement | None, ...]
    # Mesh dims of ``unsharded_mesh`` that are data-parallel (SPMD mesh): gradients may be
    # Partial there, which the reduce-scatter sums; other Partial dims are reduced first.
    dp_dims_of_unsharded: tuple[int, ...]
    # A plain parameter annotated with spmd_types: gathered plain, its gradient read as these
    # types say (``spmd_types_params``); ``None`` for a DTensor parameter.
    spmd_types: SpmdTypes | None = None

    def sharded_placements(self, ragged: RaggedShard) -> tuple[Placement, ...]:
        """The sharded parameter's placements with ``ragged`` on the data-parallel dim; a
        StridedRaggedShard when later mesh dims shard the rows it cuts; the template itself
        where it has no data-parallel dim to shard (DDP: the ragged is this rank's whole tensor)."""
        placements = list(self.sharded_template)
        if None not in placements:
            return tuple(p for p in placements if p is not None)
        dp_dim = placements.index(None)
        split_factor = math.prod(
            self.sharded_mesh.size(j)
            for j, p in enumerate(placements)
            if j > dp_dim and isinstance(p, Shard) and ragged.dims and p.dim % len(self.shape) < len(ragged.dims)
        )
        if split_factor > 1:
            ragged = StridedRaggedShard(ragged.dims, ragged.local_units, split_factor)
        # The template's only None is the data-parallel dim's.
        return tuple(ragged if p is None else p for p in placements)

    def unsharded_param(self, local: torch.Tensor) -> torch.Tensor:
        """The gathered parameter: the original DTensor over this rank's gathered local tensor
        (the local tensor itself for a plain parameter annotated with spmd_types)."""
        if self.spmd_types is not None:
            return local
        return make_dtensor(local, self.unsharded_mesh, self.unsharded_placements, self.shape, self.stride)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gathered parameter's gradient as this rank's local tensor to reduce-scatter.

        As FSDP2: the gradient is first moved to the parameter's own placements (an embedding
        under RowwiseParallel gets a Replicate gradient for a Shard(0) weight), except on
        data-parallel dims, where a Partial is what the reduce-scatter sums."""
        if isinstance(grad, AsyncCollectiveTensor):
            grad = grad.wait()
        if self.spmd_types is not None and not isinstance(grad, DTensor):
            grad = DTensor.from_local(grad, self.unsharded_mesh, self.spmd_types.grad_placements, run_check=False)
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(
            grad.placements[i] if i in self.dp_dims_of_unsharded else p for i, p in enumerate(self.unsharded_placements)
        )
        if target != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, target)
        return grad._local_tensor

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel local tensor of a full (global) value (a view)."""
        return other_dims_slice(full, self.unsharded_placements, self.unsharded_mesh)


def resolve_dp_mesh_dims(mesh: DeviceMesh, dp_mesh_dims: Any, reshard_after_forward: Any) -> SpmdMesh:
    """FSDP2's validation of ``dp_mesh_dims``, with its errors, and its data-parallel mesh."""
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard_names, replicate_names = _names(dp_mesh_dims.shard), _names(dp_mesh_dims.replicate)
    for name in (*shard_names, *replicate_names):
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError("reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)")
    if not shard_names:  # DDP: parameters replicated, gradients all-reduced over the replicas
        dp_mesh = _with_single_rank_shard_dim(_flattened(mesh, replicate_names))
    elif replicate_names:
        dp_mesh = concatenate_meshes([_flattened(mesh, replicate_names), _flattened(mesh, shard_names)])
    else:
        dp_mesh = _flattened(mesh, shard_names)
    names = mesh.mesh_dim_names
    return SpmdMesh(
        mesh, dp_mesh, tuple(names.index(n) for n in shard_names), tuple(names.index(n) for n in replicate_names)
    )


def spmd_mesh_of(mesh_info: Any) -> SpmdMesh | None:
    """The SpmdMesh of an FSDP2 mesh info built with ``dp_mesh_dims`` (a ``shard_placement_fn``
    answer, as torchtitan gives its experts), or ``None`` for one without."""
    dp_mesh_dims = getattr(mesh_info, "dp_mesh_dims", None)
    if dp_mesh_dims is None:
        return None
    full_mesh = mesh_info.spmd_mesh
    names = full_mesh.mesh_dim_names
    return SpmdMesh(
        full_mesh,
        mesh_info.mesh,
        tuple(names.index(n) for n in _names(dp_mesh_dims.shard)),
        tuple(names.index(n) for n in _names(dp_mesh_dims.replicate)),
    )


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The submesh of ``names``, several flattened into one dim as FSDP2 does (same name)."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


def _with_single_rank_shard_dim(replicate_mesh: DeviceMesh) -> DeviceMesh:
    """``replicate_mesh`` (1-D) as HSDP's 2-D mesh with a shard dim of one rank: a DDP unit's
    DBuffers hold whole tensors and its gradients are all-reduced over the replicas.

    Made once per mesh (equal submeshes share it), as FSDP2's flattened meshes are: its
    process groups are made once, not per unit. Held by the root mesh, as torch's root holds
    its flattened meshes, so it lives as long as the meshes it derives from: a module-level
    cache would keep every mesh and its groups alive past ``destroy_process_group`` (see
    :mod:`vescale_plugins.dbuffer.collectives`). Keyed by mesh value, which under a threaded
    process group includes the rank-thread.
    """
    root = replicate_mesh._get_root_mesh()
    derived: dict[DeviceMesh, DeviceMesh] = root.__dict__.setdefault(_SINGLE_RANK_SHARD_MESHES, {})
    if replicate_mesh not in derived:
        name = replicate_mesh.mesh_dim_names[0] if replicate_mesh.mesh_dim_names else "replicate"
        derived[replicate_mesh] = replicate_mesh._unflatten(
            0, (replicate_mesh.size(), 1), (name, f"{name}_single_rank_shard")
        )
    return derived[replicate_mesh]


# The root mesh's attribute holding its meshes made by _with_single_rank_shard_dim.
_SINGLE_RANK_SHARD_MESHES = "_vescale_plugins_single_rank_shard_meshes"


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def parallel_spec_for(fqn: str, param: torch.Tensor, dp_mesh: DeviceMesh, spmd: SpmdMesh | None) -> ParallelSpec | None:
    """The parameter's ParallelSpec (``None`` for a plain tensor without ``dp_mesh_dims``),
    validated: every error names the parameter and is raised before any collective."""
    annotations = annotations_of(param)
    if annotations is not None:
        stored, types = storage_of(fqn, param, annotations, spmd)
        assert spmd is not None  # storage_of refuses annotations without dp_mesh_dims
        return dataclasses.replace(_spmd_spec(fqn, stored, spmd), spmd_types=types)
    if spmd is not None:
        return _spmd_spec(fqn, param, spmd)
    if not isinstance(param, DTensor):
        return None
    tp_mesh = param.device_mesh  # one or more TP/EP dims, e.g. experts on (ep, tp)
    _check_placements(fqn, param)
    try:
        sharded_mesh = concatenate_meshes([dp_mesh, tp_mesh])
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh} that cannot be combined with the "
            f"data-parallel mesh {dp_mesh} ({e}); build both as named dims of one mesh, e.g. "
            "mesh = init_device_mesh(dev, (dp, tp), mesh_dim_names=('dp', 'tp')), and pass "
            "mesh['dp'] to fully_shard and mesh['tp'] to parallelize_module"
        ) from e
    # HSDP: (replicate, shard, *tp), Replicate on the replicate dim, as FSDP2's HSDP x TP
    template = (*[Replicate()] * (dp_mesh.ndim - 1), None, *param.placements)
    return ParallelSpec(tp_mesh, tuple(param.placements), param.shape, param.stride(), sharded_mesh, template, ())


def _spmd_spec(fqn: str, param: torch.Tensor, spmd: SpmdMesh) -> ParallelSpec:
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
            f"(e.g. via distribute_module). Got plain tensor for parameter '{fqn}'."
        )
    if param.device_mesh is not spmd.mesh:
        raise ValueError(
            "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
            f"different mesh objects (parameter '{fqn}')"
        )
    names = spmd.mesh.mesh_dim_names
    assert names is not None  # an SPMD mesh is named (checked where SpmdMesh is made)
    for kind, dims in (("shard", spmd.shard_dims), ("replicate", spmd.replicate_dims)):
        for dim in dims:
            if not isinstance(param.placements[dim], Replicate):
                raise ValueError(
                    f"Expected Replicate() on DP {kind} dim '{names[dim]}' (index {dim}) but got "
                    f"{param.placements[dim]} (parameter '{fqn}')"
                )
    _check_placements(fqn, param)
    sharded_mesh, template = _spmd_sharded_layout(param, spmd)
    return ParallelSpec(
        spmd.mesh,
        tuple(param.placements),
        param.shape,
        param.stride(),
        sharded_mesh,
        template,
        spmd.shard_dims + spmd.replicate_dims,
    )


def _spmd_sharded_layout(param: DTensor, spmd: SpmdMesh) -> tuple[DeviceMesh, tuple[Placement | None, ...]]:
    """Where the sharded parameter lives, as FSDP2: on the full mesh for one shard dim; for
    several, on the full mesh with the data-parallel mesh (flattened shard dims, after the
    replicate dim for HSDP) in the first shard dim's place and the replicate dims dropped;
    for DDP, where the module put it (FSDP2's DDP parameters keep their placements)."""
    if not spmd.shard_dims:
        return spmd.mesh, tuple(param.placements)
    first = spmd.shard_dims[0]
    if len(spmd.shard_dims) == 1:
        return spmd.mesh, tuple(None if j == first else p for j, p in enumerate(param.placements))
    names = spmd.mesh.mesh_dim_names
    assert names is not None  # an SPMD mesh is named (checked where SpmdMesh is made)
    submeshes: list[DeviceMesh] = []
    template: list[Placement | None] = []
    for j, p in enumerate(param.placements):
        if j == first:
            submeshes.append(spmd.dp_mesh)
            template.extend([Replicate(), None] if spmd.replicate_dims else [None])
        elif j not in spmd.shard_dims + spmd.replicate_dims:
            submeshes.append(spmd.mesh[names[j]])
            template.append(p)
    return concatenate_meshes(submeshes), tuple(template)


def _check_placements(fqn: str, param: DTensor) -> None:
    """``Shard(d)`` (even or not) and ``Replicate()``: every rank's local tensor is one dense
    tensor, which the planner lays out for its data-parallel group."""
    for j, p in enumerate(param.placements):
        if not (isinstance(p, Replicate) or type(p) is Shard):
            raise NotImplementedError(
                f"parameter {fqn!r} has placement {p!r} on mesh dim {j}: veScale-FSDP composes with "
                "Shard(d) and Replicate() (ColwiseParallel, RowwiseParallel, expert Shard(0))"
            )

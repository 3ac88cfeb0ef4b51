"""Every set-up check of ``fully_shard``, and the per-parameter specs the unit is built from.

A distributed set-up that fails on one rank only hangs (or aborts) the others at their first
collective, far from the cause. So :func:`plan_unit_setup` checks what each rank can check
alone (arguments, the mesh, that a module is not already inside a unit), then plans the
unit's parameters under :func:`.agreement.agree_across_ranks`, which exchanges one small
fingerprint of the plan per rank: a ``block_size_fn`` (or a model) that differs between
ranks, or an error raised on some ranks only, becomes the same clear error on every rank. Nothing here touches
the modules, so bad input leaves them as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from vescale_plugins.runtime.agreement import agree_across_ranks
from vescale_plugins.runtime.comm_policy import QuantizedComm, check_comm_policy, check_quantizable_param
from vescale_plugins.runtime.discovery import collect_params
from vescale_plugins.runtime.extensions import check_extension_param, defines_extension
from vescale_plugins.runtime.fsdp2_semantics import ShardPlacementResult
from vescale_plugins.runtime.mesh import is_group_size
from vescale_plugins.runtime.registry import fsdp_param_of, sharded_by_another_call
from vescale_plugins.runtime.tensor_parallel import (
    ParallelSpec,
    SpmdMesh,
    parallel_spec_for,
    resolve_dp_mesh_dims,
    spmd_mesh_of,
)
from vescale_plugins.runtime.unit_device import default_mesh, mesh_device

__all__ = [
    "BlockSizeFn",
    "ParamSpec",
    "PlanMismatchError",
    "SetupAssertionError",
    "UnitSetup",
    "check_reshard_after_forward",
    "normalise_reshard_after_forward",
    "plan_unit_setup",
    "refuse_with_parameter_meshes",
]

BlockSizeFn = Callable[[str, nn.Parameter], "int | None"]
PlanEntry = tuple[str, tuple[int, ...], str, int | None]  # (name, shape, dtype, block rows or None)


class PlanMismatchError(ValueError):
    """Ranks planned different units (a rank-dependent ``block_size_fn`` or model)."""


class SetupAssertionError(AssertionError, ValueError):
    """A set-up mistake FSDP2 reports with an ``AssertionError`` (and its text): raised as one,
    so code written for FSDP2 catches it, and as a ``ValueError``, as every other bad
    argument to ``fully_shard``."""


# The errors the plan's agreement carries from the ranks that raise them to the others (by name).
_CHECKED_ERRORS = (SetupAssertionError, ValueError, TypeError, NotImplementedError)


@dataclass(frozen=True, eq=False)
class ParamSpec:
    """One parameter a unit will manage, as set-up found it.

    ``owners`` are the ``(module, attribute)`` slots that hold it (more than one when tied
    within the unit); ``block_rows`` the rows of dim 0 that must stay on one rank, or ``None``
    where nothing asks for rows (no ``block_size_fn`` answer, no ``shard_placement_fn``
    answer, not tensor-parallel, no all-gather extension): the planner may then cut it
    anywhere (element-wise, see :func:`.dbuffer.planning.plan_buffers`);
    ``parallel`` how it is distributed besides FSDP (TP/EP/SPMD DTensor) or ``None``;
    ``mesh`` the mesh ``shard_placement_fn`` gave it, or ``None`` for the unit's.
    """

    fqn: str
    owners: tuple[tuple[nn.Module, str], ...]
    param: nn.Parameter
    block_rows: int | None
    parallel: ParallelSpec | None
    mesh: DeviceMesh | None

    @property
    def local(self) -> torch.Tensor:
        """What the unit's DBuffer holds of it: a DTensor's (TP/EP) local tensor."""
        return self.param._local_tensor if isinstance(self.param, DTensor) else self.param


@dataclass(frozen=True, eq=False)
class UnitSetup:
    """What ``fully_shard`` builds a unit from: the unit's mesh, its reshard policy
    (normalised: an int that equals 1 or the shard size is a bool) and its parameters."""

    mesh: DeviceMesh
    reshard_after_forward: bool | int | None
    params: list[ParamSpec]


def plan_unit_setup(
    modules: list[nn.Module],
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    offload_policy: OffloadPolicy | None,
    ignored_params: set[nn.Parameter] | None,
    dp_mesh_dims: Any,
    block_size_fn: BlockSizeFn | None,
    comm_policy: QuantizedComm | None = None,
) -> UnitSetup:
    """Check every argument and plan the unit's parameters, the same on every rank of the
    unit's shard group (see :func:`.agreement.agree_across_ranks`); raises before the modules
    change."""
    _check_modules_and_policies(modules, reshard_after_forward, offload_policy)
    if comm_policy is not None:
        check_comm_policy(comm_policy, isinstance(offload_policy, CPUOffloadPolicy))
    spmd: SpmdMesh | None = None
    if dp_mesh_dims is not None:
        mesh, spmd = _resolve_spmd_mesh(mesh, dp_mesh_dims, reshard_after_forward)
    else:
        mesh = _resolve_data_parallel_mesh(mesh)
    device = mesh_device(mesh)  # where fully_shard moves the unit's states (FSDP2's choice)
    ignored = set(ignored_params or ())

    def plan() -> list[ParamSpec]:
        params, shared = collect_params(modules, ignored)
        _check_not_already_sharded(modules[0], params)
        _check_dtensors_on(device, params)
        own_mesh, placed = (
            _check_shard_placements(params, shard_placement_fn, mesh, device)
            if shard_placement_fn is not None
            else ({}, set())
        )
        if own_mesh:
            refuse_with_parameter_meshes(next(iter(own_mesh)), reshard_after_forward)
        specs = []
        for fqn, owners, p in params:
            parallel = parallel_spec_for(fqn, p, *own_mesh.get(fqn, (mesh, spmd)))
            rows = _block_rows(fqn, p, block_size_fn)
            if rows is None and (parallel is not None or fqn in placed or defines_extension(p)):
                # Rows assumed: tensor parallelism's strided shards, FSDP2's dim-0 placement
                # the user asked for, an extension's fsdp_pre_all_gather (FSDP2's 2-D shard).
                rows = 1
            specs.append(
                ParamSpec(fqn, tuple(owners), p, rows, parallel, own_mesh[fqn][0] if fqn in own_mesh else None)
            )
        if shared:
            raise ValueError(
                "parameters shared between this unit and a unit inside it: "
                + ", ".join(shared)
                + "; shared (e.g. tied) parameters must belong to one unit: apply fully_shard to a "
                "module that contains every user of them"
            )
        _refuse_parameters_of_sibling_units(modules, specs)
        _check_tensor_extensions(specs, lambda: normalise_reshard_after_forward(reshard_after_forward, mesh))
        if comm_policy is not None:
            for spec in specs:
                check_quantizable_param(
                    comm_policy,
                    spec.fqn,
                    spec.param,
                    parallel=spec.parallel is not None,
                    own_mesh=spec.mesh is not None,
                    extension=defines_extension(spec.param),
                )
        return specs

    # Tensor-parallel parameters are planned by their local (TP) shape; a parameter on its own
    # mesh by its global shape (the unit's group may span its expert-parallel ranks, whose
    # local shapes differ where experts split unevenly).
    # Every rank raises the same error if any rank failed or planned differently (a
    # rank-dependent block_size_fn or model): each describes its plan as (name, shape, dtype,
    # block rows) per parameter.
    specs = agree_across_ranks(
        plan,
        lambda specs: [
            (s.fqn, tuple(s.local.shape if s.mesh is None else s.param.shape), str(s.param.dtype), s.block_rows)
            for s in specs
        ],
        mesh.get_group(mesh.ndim - 1),
        catch=_CHECKED_ERRORS,
        explain=lambda error: (type(error).__name__, str(error)),
        remote_failure=_remote_plan_failure,
        mismatch=_plan_mismatch,
    )
    return UnitSetup(mesh, normalise_reshard_after_forward(reshard_after_forward, mesh), specs)


# -- arguments ------------------------------------------------------------------------


def _check_modules_and_policies(modules: list[nn.Module], reshard_after_forward: Any, offload_policy: Any) -> None:
    check_reshard_after_forward(reshard_after_forward)
    if offload_policy is not None and type(offload_policy) not in (OffloadPolicy, CPUOffloadPolicy):
        raise NotImplementedError(
            f"offload_policy={offload_policy!r}: pass OffloadPolicy() (none) or CPUOffloadPolicy(pin_memory=...)"
        )
    for m in modules:
        # The module's own attribute, never getattr: a CheckpointWrapper forwards unknown
        # attributes to the module it wraps, whose unit is not the wrapper's (LitGPT shards both).
        if vars(m).get("_vescale_fsdp_unit") is not None:
            # FSDP2's error (from torch's composable-API ``contract``), for every module already
            # in a unit, also where FSDP2 itself fails later (a child listed with its parent).
            raise SetupAssertionError(
                "Each distinct composable distributed API can only be applied to a module once. fully_shard has "
                f"already been applied to the following module:\n{m}"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward (got a "
                f"{type(m).__name__}): no hook would ever gather its parameters; shard each of its "
                "blocks, or pass them as a list"
            )


def check_reshard_after_forward(value: Any) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"reshard_after_forward={value}: an int must be a positive number of ranks")
        return
    raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def normalise_reshard_after_forward(value: bool | int | None, mesh: DeviceMesh) -> bool | int | None:
    """An int is the size of the groups parameters stay sharded over after forward: it must
    divide the shard dim's size; 1 means False and the full size True, as in FSDP2."""
    if isinstance(value, bool) or value is None:
        return value
    shard_size = mesh.size(mesh.ndim - 1)
    if shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group's size ({shard_size}); "
            f"use one of {[d for d in range(1, shard_size + 1) if shard_size % d == 0]}"
        )
    return False if value == 1 else True if value == shard_size else value


def _block_rows(fqn: str, param: nn.Parameter, block_size_fn: BlockSizeFn | None) -> int | None:
    rows = block_size_fn(fqn, param) if block_size_fn is not None else None
    if rows is None:
        return None
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"block_size_fn({fqn!r}) returned {rows!r}; it must return None or a positive int (rows)")
    return rows


# -- the mesh ---------------------------------------------------------------------------


def _check_mesh(mesh: Any) -> None:
    """``mesh`` must be a DeviceMesh that contains this rank."""
    if isinstance(mesh, dist.ProcessGroup):
        raise TypeError(
            "fully_shard(mesh=...) got a ProcessGroup; pass a DeviceMesh: "
            "torch.distributed.device_mesh.DeviceMesh.from_group(group, device_type) wraps one"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard(mesh=...) must be a DeviceMesh (or None for all ranks), got {type(mesh).__name__}"
        )
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}: call fully_shard "
            "only on the ranks of its mesh, or build the mesh over every rank that calls it "
            "(init_device_mesh(device_type, (world_size,)))"
        )


def _resolve_data_parallel_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """The unit's mesh without ``dp_mesh_dims``: 1-D (shard) or 2-D with named dims
    (replicate, shard), checked with FSDP2's errors."""
    if mesh is None:
        mesh = default_mesh()
    _check_mesh(mesh)
    if mesh.ndim not in (1, 2):
        # FSDP2's text names neither fix for the meshes of tensor-parallel models; ours does.
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}; with tensor or expert parallelism "
            "pass the data-parallel submesh (parameters are DTensors on the other dims), or the full mesh "
            "with dp_mesh_dims"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise SetupAssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    return mesh


def _resolve_spmd_mesh(
    mesh: DeviceMesh | None, dp_mesh_dims: Any, reshard_after_forward: Any
) -> tuple[DeviceMesh, SpmdMesh]:
    """With ``dp_mesh_dims``, ``mesh`` is the full SPMD mesh: validated as FSDP2 does, and
    replaced by its data-parallel shard dim."""
    if not (hasattr(dp_mesh_dims, "shard") and hasattr(dp_mesh_dims, "replicate")):
        raise TypeError(f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, got {dp_mesh_dims!r}")
    full_mesh = default_mesh() if mesh is None else mesh
    _check_mesh(full_mesh)
    spmd = resolve_dp_mesh_dims(full_mesh, dp_mesh_dims, reshard_after_forward)
    return spmd.dp_mesh, spmd


# -- the parameters ---------------------------------------------------------------------


def _check_dtensors_on(device: torch.device, params: Sequence[tuple[str, Any, nn.Parameter]]) -> None:
    """fully_shard moves plain tensors to the mesh's device; a DTensor (TP/EP) must already be
    there, as FSDP2 requires (``_move_states_to_device``)."""
    for fqn, _, param in params:
        if isinstance(param, DTensor) and param.device.type != "meta" and param.device != device:
            raise ValueError(
                f"parameter {fqn!r} is a DTensor on {param.device} but the unit's mesh is on {device}: "
                "build (or move) the tensor-parallel model on the mesh's device before fully_shard"
            )


def _check_not_already_sharded(module: nn.Module, params: Sequence[tuple[str, Any, nn.Parameter]]) -> None:
    """Refuse parameters that a unit built earlier already manages: ``fully_shard`` on a child
    after its parent (parameters of units *inside* ``module`` are not collected). A DDP unit's
    (``dp_mesh_dims`` with replicate dims only) keep their placements, so the unit is asked."""
    for fqn, _, param in params:
        if fsdp_param_of(param) is not None:
            raise ValueError(
                f"fully_shard({type(module).__name__}): its parameter {fqn!r} is already sharded by fully_shard "
                "on a module that contains it; apply fully_shard bottom-up: each block (child) first, then "
                "its parent and the root"
            )


def _refuse_parameters_of_sibling_units(modules: list[nn.Module], specs: list[ParamSpec]) -> None:
    for spec in specs:
        managed_as = sharded_by_another_call(spec.param)
        if managed_as is not None:
            here = " + ".join(type(m).__name__ for m in modules)
            raise ValueError(
                f"parameter {spec.fqn!r} of the {here} module is shared with {managed_as}, which "
                "another fully_shard call already sharded; a shared (tied) parameter must belong "
                "to one unit: put both modules in one call, fully_shard([module_a, module_b]), "
                "or shard a module that contains both"
            )


def _check_tensor_extensions(specs: list[ParamSpec], reshard_after_forward: Callable[[], Any]) -> None:
    """FSDP2's all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``): what
    veScale-FSDP does not run them for is refused here, naming the parameter (extensions
    given to local tensors after ``fully_shard`` are checked at their first all-gather).
    ``reshard_after_forward`` gives the normalised policy (asked only if some parameter has
    an extension)."""
    for spec in specs:
        if defines_extension(spec.param):
            check_extension_param(
                spec.fqn,
                spec.param,
                spec.param.shape,
                parallel=spec.parallel is not None,
                own_mesh=spec.mesh is not None,
                group_size=is_group_size(reshard_after_forward()),
            )


# -- shard_placement_fn -------------------------------------------------------------------


def _check_shard_placements(
    params: list[tuple[str, Any, nn.Parameter]],
    shard_placement_fn: Callable[[nn.Parameter], Any],
    mesh: DeviceMesh,
    device: torch.device,
) -> tuple[dict[str, tuple[DeviceMesh, SpmdMesh | None]], set[str]]:
    """FSDP2's ``shard_placement_fn``, checked as FSDP2 checks it; returns the parameters it
    puts on another mesh than the unit's, and those it gave a placement (kept in rows).

    ``None`` and ``Shard(0)`` are what veScale-FSDP does. ``Shard(d)`` for another dim
    (torchtitan asks it for experts with fewer rows than ranks) is accepted and trains the
    same parameters: the planner already splits tensors with fewer rows than ranks without
    FSDP2's padding, so the parameter keeps whole rows of dim 0 per rank (placement
    ``RaggedShard``, not ``Shard(d)``), and a one-time warning says so. A
    ``ShardPlacementResult`` may also name another mesh for the parameter (torchtitan's experts over the expert-data-parallel mesh): its own DBuffers shard over it,
    and where that mesh info was built with ``dp_mesh_dims`` the parameter is a DTensor on its
    full SPMD mesh (torchtitan's experts on the sparse mesh).
    """
    other_dims, own_mesh, placed = [], {}, set()
    for fqn, _, param in params:
        placement = shard_placement_fn(param)
        if isinstance(placement, ShardPlacementResult):
            param_mesh = _parameter_mesh(fqn, placement.mesh_info, device)
            if param_mesh != mesh:
                own_mesh[fqn] = (param_mesh, spmd_mesh_of(placement.mesh_info))
            placement = placement.placement
        if fqn in own_mesh:
            placed.add(fqn)
        if placement is None:
            continue
        placed.add(fqn)
        if not isinstance(placement, Shard):
            raise ValueError(
                f"Invalid shard_placement_fn result: {placement} ({placement!r} for {fqn!r}); return a Shard, a "
                "ShardPlacementResult (torch >= 2.13) or None"
            )
        dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
        if not 0 <= dim < max(param.dim(), 1):
            # FSDP2's text, which names no parameter, then which one and where the dim came from.
            raise SetupAssertionError(
                f"Shard dim {dim} is invalid for {param.dim()}D tensor: {param.shape} (shard_placement_fn returned "
                f"{placement!r} for {fqn!r})"
            )
        if dim != 0:
            other_dims.append(f"{fqn!r} ({placement!r})")
    if other_dims and not _SHARD_DIM_WARNED:
        _SHARD_DIM_WARNED.append(True)
        more = f" and {len(other_dims) - 1} more" if len(other_dims) > 1 else ""
        warnings.warn(
            f"shard_placement_fn asked for another dim than 0 for {other_dims[0]}{more}: veScale-FSDP keeps whole "
            "rows of dim 0 per rank (uneven where needed, so tensors with fewer rows than ranks need no other dim). "
            "Training is the same; the sharded parameters' placement is RaggedShard, not Shard(d). "
            "(Warned once per process.)",
            stacklevel=6,  # the user's fully_shard call (via plan_unit_setup, agree_across_ranks, plan)
        )
    return own_mesh, placed


# One warning per process for Shard(d > 0) answers (a model asks it for every layer).
_SHARD_DIM_WARNED: list[bool] = []


def _parameter_mesh(fqn: str, mesh_info: Any, device: torch.device) -> DeviceMesh:
    """The mesh a ``ShardPlacementResult`` names, in the layouts a unit's mesh may have: 1-D
    (shard over it) or 2-D HSDP (replicate over dim 0, shard over dim 1)."""
    param_mesh = mesh_info.mesh
    replicate_dim = getattr(mesh_info, "replicate_mesh_dim", None)
    shard_dim = getattr(mesh_info, "shard_mesh_dim", None)
    layout_ok = (param_mesh.ndim == 1 and shard_dim == 0 and replicate_dim is None) or (
        param_mesh.ndim == 2 and shard_dim == 1 and replicate_dim == 0
    )
    if not layout_ok:
        raise NotImplementedError(
            f"shard_placement_fn put {fqn!r} on {type(mesh_info).__name__}(mesh={param_mesh}, shard_mesh_dim={shard_dim}, "
            f"replicate_mesh_dim={replicate_dim}): veScale-FSDP shards over a 1-D mesh, or replicates over dim 0 and "
            "shards over dim 1 of a 2-D one (HSDP)"
        )
    if param_mesh.device_type != device.type:
        raise ValueError(
            f"shard_placement_fn put {fqn!r} on a {param_mesh.device_type!r} mesh; the unit's mesh keeps its "
            f"parameters on {device.type!r}"
        )
    if param_mesh.get_coordinate() is None:
        raise ValueError(
            f"shard_placement_fn put {fqn!r} on mesh {param_mesh}, which does not hold this rank ({dist.get_rank()})"
        )
    return param_mesh


def refuse_with_parameter_meshes(first_fqn: str, reshard_after_forward: Any) -> None:
    """What a unit with parameters on their own mesh (``shard_placement_fn``) cannot do."""
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward} with parameters on their own mesh ({first_fqn!r}, from "
            "shard_placement_fn): pass True or False, as FSDP2 needs for such units"
        )


# -- agreement across ranks -----------------------------------------------------------------


def _remote_plan_failure(rank: int, explained: tuple[str, str]) -> Exception:
    class_name, text = explained
    error_class = next((c for c in _CHECKED_ERRORS if c.__name__ == class_name), ValueError)
    return error_class(f"fully_shard failed on rank {rank} of the mesh: {text}")


def _plan_mismatch(plans: list[list[PlanEntry]], rank: int) -> Exception:
    return PlanMismatchError(_describe_mismatch(plans))


def _describe_mismatch(plans: list[list[PlanEntry]]) -> str:
    fix = (
        "; block_size_fn (and the model) must give every rank the same answer: make it depend on the "
        "parameter's name and shape only, not on the rank or on local data"
    )
    reference = plans[0]
    for rank, entries in enumerate(plans[1:], start=1):
        if len(entries) != len(reference):
            return f"rank 0 plans {len(reference)} parameters for this unit but rank {rank} plans {len(entries)}" + fix
        for mine, theirs in zip(reference, entries):
            if mine != theirs:
                name, shape, dtype, rows = mine
                return (
                    f"parameter {name!r}: rank 0 has shape {shape}, {dtype}, blocks of {rows} rows; rank {rank} has "
                    f"{theirs[0]!r} shape {theirs[1]}, {theirs[2]}, blocks of {theirs[3]} rows" + fix
                )
    return "ranks planned different units" + fix

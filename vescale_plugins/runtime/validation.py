"""Set-up checks for ``fully_shard``: clear errors on every rank, before any collective.

A distributed set-up that fails on one rank only hangs (or aborts) the others at their first
collective, far from the cause. So ``fully_shard`` checks what each rank can check alone
(the mesh, that a module is not already inside a unit), then plans its parameters under
:func:`agree_on_plan`, which exchanges one small fingerprint of the plan per rank: a
``block_size_fn`` (or a model) that differs between ranks, or an error raised on some ranks
only, becomes the same clear error on every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vescale_plugins.ragged.placement import RaggedShard

__all__ = ["check_mesh", "check_not_already_sharded", "agree_on_plan", "PlanMismatchError"]

T = TypeVar("T")
PlanEntry = tuple[str, tuple[int, ...], str, int]  # (name, shape, dtype, block rows)


_CHECKED_ERRORS = (ValueError, TypeError, NotImplementedError)


class PlanMismatchError(ValueError):
    """Ranks planned different units (a rank-dependent ``block_size_fn`` or model)."""


def check_mesh(mesh: Any) -> None:
    """``mesh`` must be a 1-D DeviceMesh that contains this rank."""
    if isinstance(mesh, dist.ProcessGroup):
        raise TypeError(
            "fully_shard(mesh=...) got a ProcessGroup; pass a DeviceMesh: "
            "torch.distributed.device_mesh.DeviceMesh.from_group(group, device_type) wraps one"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard(mesh=...) must be a DeviceMesh (or None for all ranks), got {type(mesh).__name__}")
    if dist.is_initialized() and mesh.get_coordinate() is None:
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}: call fully_shard "
            "only on the ranks of its mesh, or build the mesh over every rank that calls it "
            "(init_device_mesh(device_type, (world_size,)))"
        )


def check_not_already_sharded(module: nn.Module, params: Sequence[tuple[str, Any]]) -> None:
    """Refuse ``(name, parameter)`` pairs that a unit built earlier already shards: ``fully_shard``
    on a child after its parent (parameters of units *inside* ``module`` are not passed here)."""
    for fqn, param in params:
        if isinstance(param, DTensor) and any(isinstance(p, RaggedShard) for p in param.placements):
            raise ValueError(
                f"fully_shard({type(module).__name__}): its parameter {fqn!r} is already sharded by fully_shard "
                "on a module that contains it; apply fully_shard bottom-up: each block (child) first, then "
                "its parent and the root"
            )


def _fingerprint(entries: Sequence[PlanEntry]) -> str:
    return hashlib.sha256(repr(list(entries)).encode()).hexdigest()


def agree_on_plan(plan: Callable[[], T], describe: Callable[[T], Sequence[PlanEntry]], group: dist.ProcessGroup | None) -> T:
    """``plan()`` on every rank of ``group``, then one exchange: every rank raises the same
    error if any rank failed or planned differently; else the plan is returned.

    ``describe(plan)`` lists ``(name, shape, dtype, block rows)`` per parameter.
    """
    result: T | None = None
    outcome: tuple[str, Any]
    try:
        result = plan()
        entries = list(describe(result))
        outcome = ("ok", _fingerprint(entries))
    except _CHECKED_ERRORS as error:
        outcome = ("error", error)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if outcome[0] == "error":
            raise outcome[1]
        return result  # type: ignore[return-value]
    # Errors travel as (class name, message): the exception object itself may not pickle.
    mine = outcome if outcome[0] == "ok" else ("error", (type(outcome[1]).__name__, str(outcome[1])))
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, mine, group=group)
    failed = [(rank, value) for rank, (kind, value) in enumerate(outcomes) if kind == "error"]
    if failed:
        if outcome[0] == "error":
            raise outcome[1]
        rank, (class_name, message) = failed[0]
        error_class = next((c for c in _CHECKED_ERRORS if c.__name__ == class_name), ValueError)
        raise error_class(f"fully_shard failed on rank {rank} of the mesh: {message}")
    if len({value for _, value in outcomes}) == 1:
        return result  # type: ignore[return-value]
    # Fingerprints differ: one more exchange names the first parameter that differs.
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, entries, group=group)
    raise PlanMismatchError(_describe_mismatch(everyone))


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

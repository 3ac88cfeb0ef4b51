"""Process-group plumbing both strategies share, as Lightning's own distributed strategies do it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

__all__ = [
    "STRATEGY_NAME",
    "STRATEGY_DESCRIPTION",
    "set_world_ranks",
    "init_process_group",
    "barrier",
    "broadcast",
    "all_reduce",
]

STRATEGY_NAME = "vescale_fsdp"
STRATEGY_DESCRIPTION = "veScale-FSDP: fully sharded data parallel over RaggedShard DTensors"

T = TypeVar("T")


def set_world_ranks(
    cluster_environment: ClusterEnvironment | None,
    node_rank: int,
    local_rank: int,
    num_processes: int,
    num_nodes: int,
) -> None:
    """Tell the cluster environment this process's global rank and the world size."""
    if cluster_environment is not None:
        cluster_environment.set_global_rank(node_rank * num_processes + local_rank)
        cluster_environment.set_world_size(num_nodes * num_processes)
    # Some environments ignore set_global_rank: read the rank back for rank-zero logging.
    rank = cluster_environment.global_rank() if cluster_environment is not None else 0
    # Lightning keeps the rank as an attribute of its decorator (and types it as Lightning does).
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]


def init_process_group(
    cluster_environment: ClusterEnvironment,
    root_device: torch.device,
    backend: str | None,
    timeout: timedelta | None,
) -> str:
    """Create the default process group unless it exists (torchrun, a test harness); returns the backend.

    An existing group must agree with what Lightning computed from ``devices`` / ``num_nodes``.
    """
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if root_device.type != "cpu":
        kwargs["device_id"] = root_device
    _init_dist_connection(cluster_environment, backend, **kwargs)
    expected = (cluster_environment.global_rank(), cluster_environment.world_size())
    if (dist.get_rank(), dist.get_world_size()) != expected:
        raise RuntimeError(
            f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, but the devices / num_nodes "
            f"settings and the cluster environment give rank {expected[0]} of {expected[1]}; make them agree"
        )
    return backend


def barrier(root_device: torch.device) -> None:
    if not _distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[root_device.index])
    else:
        dist.barrier()


def broadcast(obj: T, src: int = 0) -> T:
    """``obj`` from rank ``src`` on every rank (e.g. rank 0's checkpoint path)."""
    if not _distributed_is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src, group=_group.WORLD)
    return holder[0]


def all_reduce(tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
    """All-reduce a tensor (``self.log(..., sync_dist=True)`` lands here); other values pass through."""
    if isinstance(tensor, torch.Tensor):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor

"""Seconds of the collectives, from the planner's model of NCCL (one model for both).

:class:`vescale_plugins.planner.CollectiveCost` is NCCL's tuner model of an all-gather or
reduce-scatter (ring, and PAT at one rank per node); the planner's split decision runs it
with NCCL's constants, the forecast with its hardware's figures: per ring step inside a node
and across nodes, the bus bandwidths, GPUs per node. Within one node it is the alpha-beta
ring, ``(n - 1) * (alpha + B / n / beta)``. An all-reduce is a reduce-scatter then an
all-gather.
"""

from __future__ import annotations

from vescale_plugins.forecast.hardware import Hardware
from vescale_plugins.planner import CollectiveCost

__all__ = ["all_reduce_s", "collective_cost", "collective_s", "replica_ranks_per_node"]


def collective_cost(hardware: Hardware) -> CollectiveCost:
    """The planner's collective model with ``hardware``'s figures (no per-collective base)."""
    return CollectiveCost(
        gpus_per_node=hardware.gpus_per_node,
        base_latency_s=0.0,
        intra_step_s=hardware.intra_node_latency_s,
        inter_step_s=hardware.inter_node_latency_s,
        intra_bandwidth=hardware.intra_node_bandwidth,
        inter_bandwidth=hardware.inter_node_bandwidth,
    )


def collective_s(total_bytes: float, ranks: int, hardware: Hardware, ranks_per_node: int | None = None) -> float:
    """Seconds of an all-gather or reduce-scatter of ``total_bytes`` over ``ranks``
    consecutive ranks (or ``ranks_per_node`` of them per node)."""
    return collective_cost(hardware).seconds(total_bytes, ranks, ranks_per_node)


def all_reduce_s(total_bytes: float, ranks: int, hardware: Hardware, ranks_per_node: int | None = None) -> float:
    """Seconds of an all-reduce of ``total_bytes`` over ``ranks``: reduce-scatter + all-gather."""
    return 2 * collective_s(total_bytes, ranks, hardware, ranks_per_node)


def replica_ranks_per_node(hardware: Hardware, group_size: int) -> int:
    """Ranks per node of an HSDP replica group, whose ranks are ``group_size`` apart."""
    return max(1, hardware.gpus_per_node // group_size)

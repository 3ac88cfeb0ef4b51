"""Alpha-beta model of ring collectives (seconds), inside a node or across nodes.

A ring all-gather or reduce-scatter over ``n`` ranks of ``B`` bytes in total (the gathered
buffer; the reduce-scatter's input) takes ``n - 1`` steps, each moving ``B / n`` bytes over
every link at once: ``(n - 1) * (alpha + B / n / beta)``, with ``alpha`` the per-step latency
and ``beta`` the bus bandwidth (bytes/s per GPU). A ring that leaves the node runs at the
speed of its slowest link, the network. An all-reduce is a reduce-scatter then an all-gather.
"""

from __future__ import annotations

from vescale_plugins.forecast.hardware import Hardware

__all__ = ["Link", "all_reduce_s", "link_for_group", "ring_collective_s"]


class Link(tuple):
    """``(latency_s, bandwidth_bytes_per_s)`` of the slowest hop a ring crosses."""

    @property
    def latency_s(self) -> float:
        return self[0]

    @property
    def bandwidth(self) -> float:
        return self[1]


def link_for_group(hardware: Hardware, span: int) -> Link:
    """The link a group of ranks spanning ``span`` consecutive ranks uses: NVLink when they
    fit in one node (``span <= gpus_per_node``), else the network."""
    if span <= hardware.gpus_per_node:
        return Link((hardware.intra_node_latency_s, hardware.intra_node_bandwidth))
    return Link((hardware.inter_node_latency_s, hardware.inter_node_bandwidth))


def ring_collective_s(total_bytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``total_bytes`` over ``ranks``."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * (link.latency_s + total_bytes / ranks / link.bandwidth)


def all_reduce_s(total_bytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``total_bytes`` over ``ranks``."""
    return 2 * ring_collective_s(total_bytes, ranks, link)

"""``--calibrate FILE``: measure this machine and write a hardware file the forecast loads.

``ranks`` gloo processes on this machine (2 by default; as the CPU bench runs them, each
with ``cores / ranks`` threads, at least 1) measure, side by side:

* collectives: all-gather and reduce-scatter of fp32 buffers from 64 KiB to 16 MiB, both
  FSDP2's calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``) and veScale-FSDP's
  in-place ones (:mod:`vescale_plugins.dbuffer.collectives`); a least-squares line
  ``t = a + b * bytes`` per path gives the ring's latency ``a / (n - 1)`` and bus bandwidth
  ``(n - 1) / n / b`` (veScale-FSDP's path) and FSDP2's time over it at the largest size;
* compute: fp32 matmuls the size of the bench model's projections (FLOP/s per process);
* copies: a 64 MiB ``copy_`` (bytes read plus written per second per process).

Each figure is the median of repeated timings. Every process measures at the same time, so
the compute and copy rates are per process with the cores shared as the bench's ranks share
them (with more ranks than cores, each gets its share). The ring's figures are fitted at
``ranks`` ranks: calibrate at the world size you forecast (``gpus_per_node`` is set to it).
Collectives on this CPU run on the same cores as compute, so the file says
``overlaps_communication: false``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.tools.launch import launch_ranks
from vescale_plugins.tools.timing import median_seconds

__all__ = ["calibrate", "fit_alpha_beta"]

DEFAULT_RANKS = 2
SIZES_BYTES = [2**k for k in range(16, 25, 2)]  # 64 KiB .. 16 MiB
REPEATS = 7


def fit_alpha_beta(sizes_bytes: list[int], seconds: list[float], ranks: int) -> tuple[float, float]:
    """Ring latency per step (s) and bus bandwidth (bytes/s) from ``t = (n-1)(alpha + B/n/beta)``
    fitted by least squares over total sizes ``B``."""
    count = len(sizes_bytes)
    mean_b, mean_t = sum(sizes_bytes) / count, sum(seconds) / count
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes_bytes, seconds)) / sum(
        (b - mean_b) ** 2 for b in sizes_bytes
    )
    if slope <= 0:
        raise ValueError(
            f"collective times {seconds} do not grow with size {sizes_bytes}: the machine was too "
            "noisy to fit a bandwidth; calibrate again with more repeats or on a quieter machine"
        )
    intercept = max(0.0, mean_t - slope * mean_b)
    return intercept / (ranks - 1), (ranks - 1) / ranks / slope


def _measure_rank(sizes_bytes: list[int], repeats: int) -> dict[str, Any]:
    from vescale_plugins.dbuffer.collectives import all_gather_into, reduce_scatter_into

    n = dist.get_world_size()
    timings: dict[str, list[float]] = {
        "fsdp2_all_gather": [],
        "fsdp2_reduce_scatter": [],
        "vescale_all_gather": [],
        "vescale_reduce_scatter": [],
    }
    group = dist.group.WORLD
    assert group is not None  # the caller's process group is initialised
    for total in sizes_bytes:
        shard = torch.ones(total // 4 // n)  # sizes are rounded down to whole shards
        full = torch.ones(shard.numel() * n)
        timings["fsdp2_all_gather"].append(median_seconds(lambda: dist.all_gather_into_tensor(full, shard), repeats))
        timings["fsdp2_reduce_scatter"].append(median_seconds(lambda: dist.reduce_scatter_tensor(shard, full), repeats))
        timings["vescale_all_gather"].append(median_seconds(lambda: all_gather_into(full, shard, group), repeats))
        timings["vescale_reduce_scatter"].append(
            median_seconds(lambda: reduce_scatter_into(shard, full, group), repeats)
        )
    a, b = torch.randn(512, 384), torch.randn(384, 1031)
    matmul_s = median_seconds(lambda: [a @ b for _ in range(8)], repeats)
    source, target = torch.ones(16 * 2**20), torch.empty(16 * 2**20)
    copy_s = median_seconds(lambda: target.copy_(source), repeats)
    return {
        "timings": timings,
        "flops": 8 * 2 * 512 * 384 * 1031 / matmul_s,
        "copy_bandwidth": 2 * source.numel() * 4 / copy_s,
    }


def calibrate(
    path: str,
    sizes_bytes: list[int] = SIZES_BYTES,
    repeats: int = REPEATS,
    timeout_s: float = 300.0,
    ranks: int = DEFAULT_RANKS,
) -> dict[str, Any]:
    """Measure (see the module docstring), write the hardware file at ``path``, return it
    (with the raw timings under ``"measured"``). ``sizes_bytes``: the collectives' total
    sizes; ``repeats``: timings per figure (the median is kept); ``ranks``: processes."""
    if ranks < 2:
        raise ValueError(f"--calibrate-ranks {ranks}: collectives need at least 2 ranks")
    measured = launch_ranks(_measure_rank, ranks, list(sizes_bytes), repeats, timeout_s=timeout_s, backend="gloo")[0]
    t = measured["timings"]
    # Bytes as measured: each size rounded down to ``ranks`` whole fp32 shards.
    sizes_bytes = [b // 4 // ranks * ranks * 4 for b in sizes_bytes]
    latency, bandwidth = fit_alpha_beta(
        list(sizes_bytes), [(g + r) / 2 for g, r in zip(t["vescale_all_gather"], t["vescale_reduce_scatter"])], ranks
    )
    figures = {
        "name": f"this machine ({os.cpu_count()} CPUs, gloo, {ranks} ranks, calibrated)",
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "reserved_bytes": 0,
        "peak_flops_bf16": measured["flops"],
        "peak_flops_fp32": measured["flops"],
        "memory_bandwidth": measured["copy_bandwidth"],
        "copy_efficiency": 1.0,
        "gpus_per_node": ranks,
        "intra_node_latency_s": latency,
        "intra_node_bandwidth": bandwidth,
        "inter_node_latency_s": latency,
        "inter_node_bandwidth": bandwidth,
        "overlaps_communication": False,
        "fsdp2_all_gather_factor": t["fsdp2_all_gather"][-1] / t["vescale_all_gather"][-1],
        "fsdp2_reduce_scatter_factor": t["fsdp2_reduce_scatter"][-1] / t["vescale_reduce_scatter"][-1],
    }
    with open(path, "w") as f:
        json.dump(figures, f, indent=2)
    return figures | {"measured": measured}

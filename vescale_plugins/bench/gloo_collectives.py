"""``collectives``: gloo's tensor collectives against the in-place ones DBuffer uses there.

    python -m vescale_plugins.bench collectives [--world-size 2] [--shard-mib 4] [--repeats 20]

Every rank all-gathers a shard of ``--shard-mib`` MiB (fp32) into a buffer of W shards and
reduce-scatters such a buffer back into a shard, first with ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` on gloo, then with the point-to-point versions DBuffer uses there.
Time is the median over ``--repeats`` calls of the slowest rank; temporary bytes are the peak
of live tensor bytes a call allocates beyond its output (``vescale_plugins.observe.allocations.AllocationTracker``,
smallest of 3). Prints one line per call.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist

from vescale_plugins.bench.arguments import count
from vescale_plugins.dbuffer.collectives import all_gather_into, reduce_scatter_into
from vescale_plugins.observe.allocations import AllocationTracker
from vescale_plugins.ragged.ragged_collectives import all_gather_single, reduce_scatter_single
from vescale_plugins.tools.launch import launch_ranks
from vescale_plugins.tools.timing import median_seconds

__all__ = ["add_arguments", "measure", "run"]


def _calls(world: int, numel: int) -> dict[str, Callable[[], object]]:
    group = dist.group.WORLD
    assert group is not None  # launch_ranks initialised it
    shard, gathered = torch.randn(numel), torch.empty(numel * world)
    full, reduced = torch.randn(numel * world), torch.empty(numel)
    return {
        "gloo all_gather_into_tensor": lambda: all_gather_single(gathered, shard, group=group),
        "in-place all-gather": lambda: all_gather_into(gathered, shard, group),
        "gloo reduce_scatter_tensor": lambda: reduce_scatter_single(reduced, full, op=dist.ReduceOp.SUM, group=group),
        "in-place reduce-scatter": lambda: reduce_scatter_into(reduced, full, group),
    }


def measure(numel: int, repeats: int) -> dict[str, dict[str, float]]:
    """On every rank of an initialised gloo group: per call, median seconds and temporary bytes."""
    results = {}
    for name, call in _calls(dist.get_world_size(), numel).items():
        seconds = median_seconds(call, repeats, warmup=3)
        temporaries = []
        for _ in range(3):  # a free the profiler misses only adds bytes: keep the smallest
            with AllocationTracker() as tracker:
                call()
            temporaries.append(tracker.peak_bytes)
        results[name] = {"seconds": seconds, "temporary_bytes": float(min(temporaries))}
    return results


def _slowest_rank(numel: int, repeats: int) -> dict[str, dict[str, float]]:
    """On every rank: ``measure``; per call, the largest time and temporary bytes of any rank."""
    result = measure(numel, repeats)
    everyone: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    return {
        name: {key: max(r[name][key] for r in everyone) for key in ("seconds", "temporary_bytes")} for name in result
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=count(2), default=2)
    parser.add_argument("--shard-mib", type=float, default=4.0, help="each rank's shard (MiB of fp32)")
    parser.add_argument("--repeats", type=count(1), default=20, help="timed calls of each collective")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is stopped")


def run(args: argparse.Namespace) -> int:
    numel = max(1, int(args.shard_mib * 2**20 / 4))
    results = launch_ranks(
        _slowest_rank, args.world_size, numel, args.repeats, timeout_s=args.timeout, backend="gloo", threads=1
    )[0]
    print(
        f"W={args.world_size}, shards of {numel * 4 / 2**20:.2f} MiB fp32 (buffers of {args.world_size * numel * 4 / 2**20:.2f} MiB)"
    )
    for name, r in results.items():
        print(f"  {name:<28} {r['seconds'] * 1e3:8.2f} ms   temporaries {r['temporary_bytes'] / 2**20:6.2f} MiB")
    return 0

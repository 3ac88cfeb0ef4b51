"""gloo's tensor collectives against ``inplace_collectives``: time and temporary bytes.

    python -m vescale_plugins.bench.collectives [--world-size 2] [--shard-mib 4] [--repeats 20]

Every rank all-gathers a shard of ``--shard-mib`` MiB (fp32) into a buffer of W shards and
reduce-scatters such a buffer back into a shard, first with ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` on gloo, then with the point-to-point versions DBuffer uses there.
Time is the median over ``--repeats`` calls of the slowest rank; temporary bytes are the peak
of live tensor bytes a call allocates beyond its output (``bench.memory.AllocationTracker``,
smallest of 3).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vescale_plugins.dbuffer.collectives import all_gather_into, reduce_scatter_into
from vescale_plugins.ragged.collectives import _all_gather_single, _reduce_scatter_single
from vescale_plugins.observe.allocations import AllocationTracker

__all__ = ["measure", "main"]


def _calls(world: int, numel: int) -> dict[str, Callable[[], object]]:
    group = dist.group.WORLD
    shard, gathered = torch.randn(numel), torch.empty(numel * world)
    full, reduced = torch.randn(numel * world), torch.empty(numel)
    return {
        "gloo all_gather_into_tensor": lambda: _all_gather_single(gathered, shard, group=group),
        "in-place all-gather": lambda: all_gather_into(gathered, shard, group),
        "gloo reduce_scatter_tensor": lambda: _reduce_scatter_single(reduced, full, op=dist.ReduceOp.SUM, group=group),
        "in-place reduce-scatter": lambda: reduce_scatter_into(reduced, full, group),
    }


def measure(numel: int, repeats: int) -> dict[str, dict[str, float]]:
    """On every rank of an initialised gloo group: per call, median seconds and temporary bytes."""
    results = {}
    for name, call in _calls(dist.get_world_size(), numel).items():
        for _ in range(3):
            call()
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        temporaries = []
        for _ in range(3):  # a free the profiler misses only adds bytes: keep the smallest
            with AllocationTracker() as tracker:
                call()
            temporaries.append(tracker.peak_bytes)
        results[name] = {"seconds": statistics.median(seconds), "temporary_bytes": float(min(temporaries))}
    return results


def _worker(rank: int, world: int, port: int, numel: int, repeats: int, queue: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        result = measure(numel, repeats)
        everyone: list[dict] = [{}] * world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            queue.put({name: {"seconds": max(r[name]["seconds"] for r in everyone), "temporary_bytes": max(r[name]["temporary_bytes"] for r in everyone)} for name in result})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m vescale_plugins.bench.collectives", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shard-mib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    numel = max(1, int(args.shard_mib * 2**20 / 4))
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(_worker, args=(args.world_size, _free_port(), numel, args.repeats, queue), nprocs=args.world_size, start_method="spawn")
    results = queue.get(timeout=60)
    print(f"W={args.world_size}, shards of {numel * 4 / 2**20:.2f} MiB fp32 (buffers of {args.world_size * numel * 4 / 2**20:.2f} MiB)")
    for name, r in results.items():
        print(f"  {name:<28} {r['seconds'] * 1e3:8.2f} ms   temporaries {r['temporary_bytes'] / 2**20:6.2f} MiB")
    return results


if __name__ == "__main__":
    main()

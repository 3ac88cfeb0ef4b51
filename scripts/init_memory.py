"""Peak memory of meta-device initialisation: veScale-FSDP against FSDP2, side by side.

    python scripts/init_memory.py [--rows 10000] [--cols 5000] [--world-size 2]

Each engine runs in fresh gloo processes: build ``nn.Linear(cols, rows)`` (``rows * cols``
elements, default 50M) on the meta device, ``fully_shard`` it, ``to_empty(device="cpu")`` and
``reset_parameters()``. Reported per engine: the largest rise of peak RSS (``ru_maxrss``)
over the ranks, from just before ``to_empty`` to after initialisation, in MiB.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank: int, world: int, port: int, engine: str, rows: int, cols: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if engine == "vescale":
            from vescale_plugins import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        with torch.device("meta"):
            model = nn.Linear(cols, rows, bias=False)
        fully_shard(model)
        before = _peak_rss_mib()
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.reset_parameters()
        rise = _peak_rss_mib() - before
        checksum = model.weight.full_tensor()[:4, :4].sum().item() if rows * cols <= 1 << 27 else 0.0
        dist.barrier()
        if rank == 0:
            queue.put(None)
        rises = [None] * world
        dist.all_gather_object(rises, rise)
        if rank == 0:
            queue.put((max(rises), checksum))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--cols", type=int, default=5000)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    results = {}
    for engine in ("fsdp2", "vescale"):
        queue = mp.get_context("spawn").Queue()
        mp.start_processes(_worker, args=(args.world_size, _free_port(), engine, args.rows, args.cols, queue), nprocs=args.world_size, start_method="spawn")
        queue.get(timeout=600)
        results[engine] = queue.get(timeout=600)
    full_mib = args.rows * args.cols * 4 / 2**20
    print(f"{args.rows * args.cols / 1e6:.0f}M-element fp32 parameter ({full_mib:.0f} MiB), W={args.world_size}")
    for engine, (rise, _) in results.items():
        print(f"  {engine:<8} peak RSS rise at init: {rise:7.1f} MiB")
    print(f"  veScale / FSDP2: {results['vescale'][0] / results['fsdp2'][0]:.2f}")


if __name__ == "__main__":
    main()

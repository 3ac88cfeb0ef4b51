"""``init-memory``: peak memory of meta-device initialisation, veScale-FSDP against FSDP2.

    python -m vescale_plugins.bench init-memory [--rows 10000] [--cols 5000] [--world-size 2]

Each engine runs in fresh gloo processes: build ``nn.Linear(cols, rows)`` (``rows * cols``
elements, default 50M) on the meta device, ``fully_shard`` it, ``to_empty(device="cpu")`` and
``reset_parameters()``. Reported per engine: the largest rise of peak RSS (``ru_maxrss``)
over the ranks, from just before ``to_empty`` to after initialisation, in MiB.
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from vescale_plugins import fully_shard
from vescale_plugins.bench.arguments import count
from vescale_plugins.bench.engines import ENGINES
from vescale_plugins.tools.launch import launch_ranks

__all__ = ["add_arguments", "run"]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _init_rise_mib(engine: str, rows: int, cols: int) -> float:
    """This rank's rise of peak RSS (MiB) over ``to_empty`` and ``reset_parameters``."""
    shard = fully_shard if engine == "vescale" else torch_fully_shard
    with torch.device("meta"):
        model = nn.Linear(cols, rows, bias=False)
    shard(model)
    before = _peak_rss_mib()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    return _peak_rss_mib() - before


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=count(1), default=10000)
    parser.add_argument("--cols", type=count(1), default=5000)
    parser.add_argument("--world-size", type=count(1), default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per engine before every rank is stopped")


def run(args: argparse.Namespace) -> int:
    rises = {
        engine: max(
            launch_ranks(
                _init_rise_mib,
                args.world_size,
                engine,
                args.rows,
                args.cols,
                timeout_s=args.timeout,
                backend="gloo",
                threads=1,
            )
        )
        for engine in ENGINES
    }
    full_mib = args.rows * args.cols * 4 / 2**20
    print(f"{args.rows * args.cols / 1e6:.0f}M-element fp32 parameter ({full_mib:.0f} MiB), W={args.world_size}")
    for engine, rise in rises.items():
        print(f"  {engine:<8} peak RSS rise at init: {rise:7.1f} MiB")
    print(f"  veScale / FSDP2: {rises['vescale'] / rises['fsdp2']:.2f}")
    return 0

"""``step``: the comparison on the Linear stack (``linear_stack``): one training step of
``--layers`` x (Linear(dim, dim), ReLU), each Linear a unit, at its plainest.

The same engines, launcher and report as the default comparison; a batch is
``--batch-size`` rows of ``--dim`` features per rank (so its "tokens" are rows).
"""

from __future__ import annotations

import argparse

from vescale_plugins.bench.arguments import count
from vescale_plugins.bench.compare import (
    add_run_arguments,
    check_megatron_precision,
    check_reshard_group,
    report_comparison,
    world_size,
)
from vescale_plugins.bench.engines import BenchSettings
from vescale_plugins.bench.linear_stack import LinearStackConfig

__all__ = ["add_arguments", "run"]

_DEFAULT = LinearStackConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=count(1), default=_DEFAULT.num_layers, help="Linear layers (one unit each)")
    parser.add_argument("--dim", type=count(1), default=_DEFAULT.dim, help="in = out features of each Linear")
    add_run_arguments(parser)
    parser.set_defaults(batch_size=16, warmup=5, steps=30, json="bench_step.json", plot="bench_step.png")


def run(args: argparse.Namespace) -> int:
    world = world_size(args)
    check_reshard_group(args.reshard_after_forward, world)
    check_megatron_precision(args.engines, args.precision)
    config = LinearStackConfig(args.layers, args.dim)
    settings = BenchSettings(
        config,
        args.batch_size,
        1,
        args.precision == "bf16-mixed",
        args.reshard_after_forward,
        args.block_rows,
        "plain",
        args.seed,
        engines=args.engines,
    )
    return report_comparison(settings, world, args, label=f"{args.layers} x Linear({args.dim})")

"""``python -m vescale_plugins.forecast``: memory per rank and step time of veScale-FSDP and
FSDP2 at the given GPU counts, by calculation (no GPU needed). Prints a table per world size,
writes JSON and a PNG. ``--calibrate FILE`` instead measures this machine's collectives,
compute and copy rates and writes them as a hardware file for ``--hardware-file``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from vescale_plugins.forecast.hardware import GPUS, load_hardware
from vescale_plugins.forecast.memory import OPTIMIZERS, PRECISIONS


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: give comma-separated integers, e.g. 8,64,256") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: give positive integers")
    return sizes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vescale_plugins.forecast", description=__doc__)
    parser.add_argument(
        "--model",
        default="Llama-3-70B",
        help="a catalogue name (vescale_plugins/tools/model_catalog.py) or a Hugging Face config.json",
    )
    parser.add_argument(
        "--gpus", type=_world_sizes, default=[8, 64, 256, 1024, 8192], help="world sizes, comma-separated"
    )
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument(
        "--hardware-file", default=None, help="JSON of Hardware fields replacing --gpu's (as --calibrate writes)"
    )
    parser.add_argument(
        "--hsdp", type=int, default=1, metavar="R", help="replicate R times, shard over W/R (hybrid sharding)"
    )
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16-mixed")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="tokens per GPU per step")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--block-rows", type=int, default=None, help="veScale: blocks of this many dim-0 rows stay on one rank"
    )
    parser.add_argument(
        "--comm",
        choices=["exact", "int8", "int8-grads"],
        default="exact",
        help="veScale-FSDP's collectives: exact, int8 weight gathers, or int8 gradient reductions too",
    )
    parser.add_argument("--quant-block", type=int, default=256, help="--comm: elements per quantization block")
    parser.add_argument(
        "--quant-gbps",
        type=float,
        default=None,
        help="--comm: the (de)quantization kernels' GB/s over the bytes they read and write (default: the copy rate)",
    )
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of peak matmul FLOP/s the model reaches")
    parser.add_argument(
        "--no-activation-checkpointing",
        action="store_true",
        help="peak and step time without checkpointing (both are shown)",
    )
    parser.add_argument("--json", default="forecast.json")
    parser.add_argument("--plot", default="forecast.png", help="'' for none")
    parser.add_argument(
        "--calibrate",
        default=None,
        metavar="FILE",
        help="measure this machine (gloo processes) and write a hardware file; nothing else",
    )
    parser.add_argument(
        "--calibrate-ranks",
        type=int,
        default=2,
        metavar="N",
        help="--calibrate on N processes (the world size you forecast; default 2)",
    )
    args = parser.parse_args(argv)
    if args.calibrate_ranks < 2:
        parser.error(f"--calibrate-ranks {args.calibrate_ranks}: collectives need at least 2 ranks")
    if args.hsdp < 1:
        parser.error(f"--hsdp {args.hsdp}: must be >= 1")
    if args.batch_tokens < 1 or args.seq_len < 1:
        parser.error("--batch-tokens and --seq-len must be positive")
    if args.quant_block < 2 or (args.quant_gbps is not None and args.quant_gbps <= 0):
        parser.error("--quant-block must be >= 2 and --quant-gbps > 0")
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu {args.mfu}: must be in (0, 1]")
    bad = [w for w in args.gpus if w % args.hsdp]
    if bad:
        parser.error(f"--hsdp {args.hsdp} does not divide --gpus {bad}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console()
    if args.calibrate:
        from vescale_plugins.forecast.calibrate import calibrate

        figures = calibrate(args.calibrate, ranks=args.calibrate_ranks)
        console.print(figures)
        console.print(f"wrote {args.calibrate}")
        return 0
    from vescale_plugins.forecast.forecast import forecast
    from vescale_plugins.forecast.model import resolve_model
    from vescale_plugins.forecast.report import render_tables, write_plot
    from vescale_plugins.forecast.settings import ForecastSettings
    from vescale_plugins.tools.outputs import write_results

    try:
        spec = resolve_model(args.model)
        hardware = load_hardware(args.gpu, args.hardware_file)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    settings = ForecastSettings(
        precision=args.precision,
        optimizer=args.optimizer,
        tokens_per_gpu=args.batch_tokens,
        seq_len=args.seq_len,
        replicas=args.hsdp,
        block_rows=args.block_rows,
        mfu=args.mfu,
        activation_checkpointing=not args.no_activation_checkpointing,
        comm=args.comm,
        quant_block=args.quant_block,
        quant_bytes_per_s=args.quant_gbps * 1e9 if args.quant_gbps else None,
    )
    start = time.perf_counter()
    result = forecast(spec, hardware, args.gpus, settings)
    result["seconds"] = time.perf_counter() - start
    for table in render_tables(result):
        console.print(table)
    console.print(f"{spec.name}: {result['parameters'] / 1e9:.1f}B parameters; forecast in {result['seconds']:.2f} s")
    write_results(console.print, result, args.json, args.plot, lambda path: write_plot(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

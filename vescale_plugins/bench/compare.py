"""The side-by-side comparison (the default subcommand, ``make bench``): its arguments, and
the run and report every model shares (table, verdict, parity line, JSON, plot).

Defaults finish in a few minutes on a 2-core CPU (gloo, 2 ranks) and use every GPU when
CUDA is available (NCCL, one rank per GPU).
"""

from __future__ import annotations

import argparse
import difflib
import os

import torch

from vescale_plugins.bench.arguments import count, reshard_choice
from vescale_plugins.bench.engines import (
    ALL_ENGINES,
    ENGINES,
    FRONTENDS,
    MEGATRON_ENGINES,
    PEER_ENGINES,
    BenchSettings,
    deepspeed_config,
)
from vescale_plugins.bench.llama import PRESETS, LlamaConfig
from vescale_plugins.bench.quantized_comm import comm_list
from vescale_plugins.bench.report import LABELS, environment, parity_line, render_table, summarize, write_plot
from vescale_plugins.bench.runner import launch, settings_dict
from vescale_plugins.tools.outputs import write_json, write_results

__all__ = [
    "add_arguments",
    "add_run_arguments",
    "bench_settings",
    "check_megatron_precision",
    "check_reshard_group",
    "report_comparison",
    "run",
]


def _model_name(name: str) -> str:
    """A preset or a local config directory, checked offline (a typo must not wait on the network)."""
    if name in PRESETS or os.path.isdir(name):
        return name
    if "/" not in name:  # not a Hugging Face hub id either
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise argparse.ArgumentTypeError(
            f"{name!r} is neither a preset ({', '.join(PRESETS)}){hint} nor a directory with a Hugging Face config.json"
        )
    return name


def engine_list(text: str) -> tuple[str, ...]:
    """``--engines``: a comma-separated list; FSDP2 (the reference) and veScale always run,
    first, and an engine whose library is missing is refused with how to install it."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in ALL_ENGINES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown engine {unknown[0]!r}: choose from {', '.join(ALL_ENGINES)}")
    import importlib.util

    if "deepspeed" in names and importlib.util.find_spec("deepspeed") is None:
        raise argparse.ArgumentTypeError(
            "deepspeed is not installed: pip install -e '.[deepspeed]' (or make bench-peers)"
        )
    if set(names) & set(MEGATRON_ENGINES) and importlib.util.find_spec("megatron_fsdp") is None:
        raise argparse.ArgumentTypeError(
            "megatron-fsdp is not installed: pip install 'megatron-fsdp==0.6.1' (the test extra has it; or make bench-peers)"
        )
    return (*ENGINES, *(name for name in ALL_ENGINES if name in names and name not in ENGINES))


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What every comparison takes, whatever the model: ranks, precision, sharding, steps, outputs."""
    parser.add_argument(
        "--engines",
        type=engine_list,
        default=ENGINES,
        metavar="NAMES",
        help=f"comma-separated, from {', '.join(ALL_ENGINES)} (FSDP2 and veScale always run; megatron-fsdp-v2: "
        "Megatron-FSDP's experimental version; deepspeed: ZeRO-3)",
    )
    parser.add_argument("--world-size", type=count(1), default=None, help="ranks (default: GPUs if CUDA, else 2)")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16-mixed"],
        default="fp32",
        help="bf16-mixed: bf16 params and all-gather, fp32 reduce",
    )
    parser.add_argument(
        "--reshard-after-forward",
        type=reshard_choice,
        default=None,
        metavar="{true,false,default,K}",
        help="K: keep parameters sharded over groups of K ranks between forward and backward",
    )
    parser.add_argument(
        "--block-rows", type=count(1), default=None, help="veScale: keep blocks of this many rows whole on one rank"
    )
    parser.add_argument("--batch-size", type=count(1), default=4)
    parser.add_argument("--warmup", type=count(0), default=2, help="steps per engine before timing")
    parser.add_argument("--steps", type=count(1), default=24, help="timed steps per engine (interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--record",
        default="",
        metavar="PATH",
        help="also write veScale-FSDP's run record (JSON) of 2 more steps and print its summary",
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before every rank is stopped")
    parser.add_argument("--json", default="bench_result.json", help="where to write every figure and the environment")
    parser.add_argument("--plot", default="bench_result.png", help="where to write the plot ('' for none)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=_model_name,
        default="small",
        help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config directory (needs transformers)",
    )
    parser.add_argument(
        "--hsdp",
        type=count(1),
        default=1,
        metavar="R",
        help="HSDP: R replicas of world/R-rank shard groups (a 2-D mesh, plain front end)",
    )
    parser.add_argument(
        "--frontend",
        choices=FRONTENDS,
        default="plain",
        help="what drives veScale-FSDP (FSDP2 is always driven by plain fully_shard)",
    )
    parser.add_argument("--seq-len", type=count(1), default=128)
    parser.add_argument(
        "--comm",
        type=comm_list,
        default=None,
        metavar="int8[,int8-grads]",
        help="also run veScale-FSDP with quantized collectives (int8: weights; int8-grads: weights and gradients) "
        "beside its exact run and FSDP2: bytes per step, step time, losses",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile each decoder layer (fullgraph) before sharding it, as torchtitan; both engines, plain front end",
    )
    add_run_arguments(parser)


def _model_config(name: str) -> LlamaConfig:
    if name in PRESETS:
        return PRESETS[name]
    try:
        from transformers import AutoConfig
    except ImportError:
        raise SystemExit(
            f"--model {name!r} is not a preset ({', '.join(PRESETS)}) and transformers is not installed"
        ) from None
    hf = AutoConfig.from_pretrained(name)
    return LlamaConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", hf.num_attention_heads),
        max_position_embeddings=hf.max_position_embeddings,
        rope_theta=getattr(hf, "rope_theta", 10000.0),
        tie_word_embeddings=getattr(hf, "tie_word_embeddings", False),
    )


def world_size(args: argparse.Namespace) -> int:
    """``--world-size``, or every GPU under CUDA, else 2."""
    return args.world_size or (torch.cuda.device_count() if torch.cuda.is_available() else 2)


def check_megatron_precision(engines: tuple[str, ...], precision: str) -> None:
    """Refuse the Megatron-FSDP engines unless fp32: its mixed precision trains a model cast to
    bf16, so its main weights would not start from the others' fp32 values."""
    megatron = [name for name in engines if name in MEGATRON_ENGINES]
    if megatron and precision != "fp32":
        raise SystemExit(
            f"--engines {megatron[0]} runs with --precision fp32 (Megatron-FSDP's mixed precision casts the "
            "model itself, so its main weights would not start from the others' fp32 values)"
        )


def check_reshard_group(reshard: bool | int | None, shard_size: int) -> None:
    """Refuse ``--reshard-after-forward K`` unless K divides the shard group's ``shard_size`` ranks."""
    if not isinstance(reshard, bool) and reshard is not None and shard_size % reshard:
        raise SystemExit(f"--reshard-after-forward {reshard} must divide the shard group's size ({shard_size})")


def bench_settings(args: argparse.Namespace) -> tuple[BenchSettings, int]:
    """The settings and world size ``add_arguments``' options ask for; ``SystemExit`` naming
    an option that cannot hold with the others."""
    world = world_size(args)
    config = _model_config(args.model)
    if world % args.hsdp:
        raise SystemExit(f"--hsdp {args.hsdp} must divide the world size ({world})")
    if args.hsdp > 1 and args.frontend != "plain":
        raise SystemExit("--hsdp runs with --frontend plain (the front ends' HSDP switches are tested in tests/)")
    peers = [name for name in args.engines if name in PEER_ENGINES]
    if args.hsdp > 1 and peers:
        raise SystemExit(f"--engines {peers[0]} runs with --hsdp 1 (the peers shard over every rank here)")
    if args.compile and args.frontend != "plain":
        raise SystemExit("--compile runs with --frontend plain (the front ends leave compiling to the user)")
    if args.compile and peers:
        raise SystemExit(f"--compile runs with --engines fsdp2,vescale ({peers[0]} is not compiled here)")
    check_megatron_precision(args.engines, args.precision)
    check_reshard_group(args.reshard_after_forward, world // args.hsdp)
    if args.seq_len > config.max_position_embeddings:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the model's {config.max_position_embeddings} positions")
    settings = BenchSettings(
        config,
        args.batch_size,
        args.seq_len,
        args.precision == "bf16-mixed",
        args.reshard_after_forward,
        args.block_rows,
        args.frontend,
        args.seed,
        args.hsdp,
        args.engines,
        args.compile,
    )
    return settings, world


def run(args: argparse.Namespace) -> int:
    """The Llama-style decoder (a preset or a Hugging Face config), both engines side by side."""
    settings, world = bench_settings(args)
    if args.comm:
        from vescale_plugins.bench import quantized_comm

        return quantized_comm.run(args, settings, world)
    return report_comparison(settings, world, args, label=args.model)


def report_comparison(settings: BenchSettings, world: int, args: argparse.Namespace, label: str) -> int:
    """Run the engines on ``world`` ranks (``add_run_arguments``' steps, record, timeout),
    print the table, the verdict and the parity line, write the JSON and the plot; 1 if a
    rank failed (no ratios then)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    ds_config = deepspeed_config(settings) if "deepspeed" in settings.engines else None
    if ds_config is not None:
        console.print(f"DeepSpeed ZeRO-3 settings: {ds_config['zero_optimization']}")
    total = len(settings.engines) * (args.warmup + args.steps + 1)
    # What each progress event from rank 0 means (runner.run_rank): a warm-up step, a timed
    # step of an engine, an engine's memory measurement.
    phases = {"warmup": "warm-up", "memory": "peak memory", **{name: "interleaved steps" for name in settings.engines}}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{label} on {world} ranks: building", total=total)

        def advance(what: str) -> None:
            progress.update(task, advance=1, description=f"{label} on {world} ranks: {phases[what]}")

        try:
            results = launch(
                settings,
                world,
                args.warmup,
                args.steps,
                args.timeout,
                advance,
                record_steps=2 if args.record else 0,
            )
        except RuntimeError as error:
            console.print(f"[red]benchmark failed, no ratios reported:[/red] {error}")
            return 1
    summary = summarize(results, tokens_per_step=world * settings.batch_size * settings.seq_len)
    console.print(render_table(summary))
    console.print(f"verdict: {summary['verdict']}")
    for name, versus in summary.get("versus", {}).items():
        console.print(f"verdict against {LABELS[name]}: {versus['verdict']}")
    console.print(parity_line(summary))
    if args.record:
        records = [r.pop("record") for r in results]
        write_json(args.record, {"ranks": [r["record"] for r in records]})
        console.print(records[0]["summary"])
        console.print(f"wrote {args.record}")
    record = {
        "settings": settings_dict(settings),
        **({"deepspeed_config": ds_config} if ds_config is not None else {}),
        "environment": environment(world),
        "summary": summary,
        "ranks": results,
    }
    write_results(console.print, record, args.json, args.plot, lambda path: write_plot(path, summary))
    return 0

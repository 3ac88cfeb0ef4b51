"""``python -m vescale_plugins.bench``: veScale-FSDP and FSDP2 side by side on this machine.

Defaults finish in a few minutes on a 2-core CPU (gloo, 2 ranks) and use every GPU when
CUDA is available (NCCL, one rank per GPU). Prints a table, writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Sequence

import torch

from vescale_plugins.bench.engines import ENGINES, FRONTENDS, BenchSettings
from vescale_plugins.bench.llama import PRESETS, LlamaConfig
from vescale_plugins.bench.report import environment, parity_line, render_table, summarize, write_json, write_plot
from vescale_plugins.bench.runner import launch, settings_dict


def _count(minimum: int):
    """An argparse type: an int of at least ``minimum``, refused with a clear message otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be at least {minimum}")
        return value

    return parse


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


def _reshard_choice(text: str) -> bool | int | None:
    """true / false / default (FSDP2's: every unit but the root), or a number of ranks."""
    choices = {"true": True, "false": False, "default": None}
    if text.lower() in choices:
        return choices[text.lower()]
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false, default or a number of ranks") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: a number of ranks is at least 1")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vescale_plugins.bench", description=__doc__)
    parser.add_argument("--model", type=_model_name, default="small", help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config directory (needs transformers)")
    parser.add_argument("--world-size", type=_count(1), default=None, help="ranks (default: GPUs if CUDA, else 2)")
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed"], default="fp32", help="bf16-mixed: bf16 params and all-gather, fp32 reduce")
    parser.add_argument("--reshard-after-forward", type=_reshard_choice, default=None, metavar="{true,false,default,K}", help="K: keep parameters sharded over groups of K ranks between forward and backward")
    parser.add_argument("--hsdp", type=_count(1), default=1, metavar="R", help="HSDP: R replicas of world/R-rank shard groups (a 2-D mesh, plain front end)")
    parser.add_argument("--block-rows", type=_count(1), default=None, help="veScale: keep blocks of this many rows whole on one rank")
    parser.add_argument("--frontend", choices=FRONTENDS, default="plain", help="what drives veScale-FSDP (FSDP2 is always driven by plain fully_shard)")
    parser.add_argument("--batch-size", type=_count(1), default=4)
    parser.add_argument("--seq-len", type=_count(1), default=128)
    parser.add_argument("--warmup", type=_count(0), default=2, help="steps per engine before timing")
    parser.add_argument("--steps", type=_count(1), default=24, help="timed steps per engine (interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", default="", metavar="PATH", help="also write veScale-FSDP's run record (JSON) of 2 more steps and print its summary")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before every rank is stopped")
    parser.add_argument("--json", default="bench_result.json", help="where to write every figure and the environment")
    parser.add_argument("--plot", default="bench_result.png", help="where to write the plot ('' for none)")
    return parser.parse_args(argv)


def _model_config(name: str) -> LlamaConfig:
    if name in PRESETS:
        return PRESETS[name]
    try:
        from transformers import AutoConfig
    except ImportError:
        raise SystemExit(f"--model {name!r} is not a preset ({', '.join(PRESETS)}) and transformers is not installed")
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


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import Progress

    args = parse_args(argv)
    world = args.world_size or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    config = _model_config(args.model)
    if world % args.hsdp:
        raise SystemExit(f"--hsdp {args.hsdp} must divide the world size ({world})")
    if args.hsdp > 1 and args.frontend != "plain":
        raise SystemExit("--hsdp runs with --frontend plain (the front ends' HSDP switches are tested in tests/)")
    shard_size = world // args.hsdp
    reshard = args.reshard_after_forward
    if not isinstance(reshard, bool) and reshard is not None and shard_size % reshard:
        raise SystemExit(f"--reshard-after-forward {reshard} must divide the shard group's size ({shard_size})")
    if args.seq_len > config.max_position_embeddings:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds the model's {config.max_position_embeddings} positions")
    settings = BenchSettings(config, args.batch_size, args.seq_len, args.precision == "bf16-mixed", args.reshard_after_forward, args.block_rows, args.frontend, args.seed, args.hsdp)
    console = Console()
    total = len(ENGINES) * (args.warmup + args.steps + 1)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{args.model} on {world} ranks", total=total)
        try:
            results = launch(settings, world, args.warmup, args.steps, args.timeout, lambda _: progress.advance(task), record_steps=2 if args.record else 0)
        except (RuntimeError, TimeoutError) as error:
            console.print(f"[red]benchmark failed, no ratios reported:[/red] {error}")
            return 1
    summary = summarize(results, tokens_per_step=world * args.batch_size * args.seq_len)
    console.print(render_table(summary))
    console.print(f"verdict: {summary['verdict']}")
    console.print(parity_line(summary))
    if args.record:
        records = [r.pop("record") for r in results]
        write_json(args.record, {"ranks": [r["record"] for r in records]})
        console.print(records[0]["summary"])
        console.print(f"wrote {args.record}")
    record = {"settings": settings_dict(settings), "environment": environment(world), "summary": summary, "ranks": results}
    write_json(args.json, record)
    console.print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, summary)
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

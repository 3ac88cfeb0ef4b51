"""``scale``: both engines at 1,024 to 16,384 ranks, on torch's fake process group.

    python -m vescale_plugins.bench scale [--world-sizes 8 64 1024 8192] [--model llama3-8b-block]
        [--setup-model Llama-3.1-405B --setup-world-size 16384]

One process per (engine, W) plays rank 0 of a W-rank job (``scale_run`` says what it measures
and how): set-up per ``fully_shard``, padding, sharded bytes and peak RSS per rank, and per
training step host time, aten ops and collectives, ours and FSDP2's side by side. With
``--setup-model`` a whole catalogue model is also sharded on the meta device at
``--setup-world-size`` (set-up only). Prints a table and writes JSON and a plot of host time
and ops against W.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from vescale_plugins.bench.arguments import count
from vescale_plugins.bench.engines import ENGINES
from vescale_plugins.bench.scale_run import STEP_MODELS
from vescale_plugins.tools.model_catalog import CATALOG
from vescale_plugins.tools.outputs import pyplot, write_results

__all__ = ["add_arguments", "run"]

# glibc keeps freed memory, as a caching allocator does (see scale_run).
_KEEP_HEAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", type=count(2), nargs="+", default=[8, 64, 1024, 8192])
    parser.add_argument("--model", choices=sorted(STEP_MODELS), default="llama3-8b-block")
    parser.add_argument("--setup-model", choices=sorted(CATALOG), default=None, help="a catalogue model to shard whole")
    parser.add_argument("--setup-world-size", type=count(2), default=16384)
    parser.add_argument("--steps", type=count(1), default=3, help="measured steps (the least is reported)")
    parser.add_argument("--warmup", type=count(1), default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per (engine, W) process")
    parser.add_argument("--json", default="bench_scale.json")
    parser.add_argument("--plot", default="bench_scale.png", help="'' for none")


def _measure(engine: str, world: int, model: str, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """``scale_run`` in a fresh process (one fake group each, its own peak RSS)."""
    command = [sys.executable, "-m", "vescale_plugins.bench.scale_run", engine, str(world), model, str(steps)]
    done = subprocess.run(
        [*command, str(warmup)],
        env={**os.environ, **_KEEP_HEAP},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{engine} at W={world} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown, one line per W, ours / FSDP2's in each cell."""
    by_world: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_world.setdefault(row["world_size"], {})[row["engine"]] = row
    columns = [
        ("aten ops per step", "ops_per_step", "{:,}"),
        ("collectives per step", "collectives_per_step", "{}"),
        ("host CPU per step (ms)", "host_ms_per_step", "{:.1f}"),
        ("set-up per unit (ms)", "setup_ms_per_unit", "{:.1f}"),
        ("padding", "padding", "{:.2%}"),
        ("sharded MiB per rank", "sharded_bytes_per_rank", "{}"),
        ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
    ]
    lines = [
        "| W | " + " | ".join(f"{title}, ours / FSDP2" for title, _, _ in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for world in sorted(by_world):
        ours, theirs = by_world[world]["vescale"], by_world[world]["fsdp2"]
        cells = []
        for _, key, form in columns:
            if key == "sharded_bytes_per_rank":
                cells.append(f"{ours[key] / 2**20:.2f} / {theirs[key] / 2**20:.2f}")
            else:
                cells.append(f"{form.format(ours[key])} / {form.format(theirs[key])}")
        lines.append(f"| {world:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _forecast_verdict(row: dict[str, Any]) -> str:
    check = row["memory_vs_forecast"]
    if check["equal"]:
        return f"equal to the forecast's ({check['executed']['sharded_params']:,} sharded bytes)"
    return f"DIFFER from the forecast's: executed {check['executed']}, forecast {check['forecast']}"


def _draw(rows: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    fig, (host, ops) = plt.subplots(1, 2, figsize=(10, 4))
    for engine, label in (("vescale", "veScale-FSDP"), ("fsdp2", "FSDP2")):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["world_size"])
        worlds = [r["world_size"] for r in mine]
        host.plot(worlds, [r["host_ms_per_step"] for r in mine], marker="o", label=label)
        ops.plot(worlds, [r["ops_per_step"] for r in mine], marker="o", label=label)
    for axes, title in ((host, "host CPU per step (ms)"), (ops, "aten ops per step")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("world size W (fake process group)")
        axes.set_title(title)
        axes.set_ylim(bottom=0)
        axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    rows = []
    for world in args.world_sizes:
        for engine in ENGINES:
            rows.append(_measure(engine, world, args.model, args.steps, args.warmup, args.timeout))
            print(f"  {engine:<8} W={world:<6} done", flush=True)
    record: dict[str, Any] = {"model": args.model, "runs": rows}
    print(table(rows))
    for row in rows:
        if "memory_vs_forecast" in row:
            print(f"  W={row['world_size']:<6} per-rank buffers {_forecast_verdict(row)}")
    if args.setup_model is not None:
        whole = [
            _measure(engine, args.setup_world_size, args.setup_model, args.steps, args.warmup, args.timeout)
            for engine in ENGINES
        ]
        record["whole_model_setup"] = whole
        for row in whole:
            print(
                f"{row['engine']:<8} {args.setup_model} ({row['units']} units) at W={row['world_size']:,}: "
                f"set-up {row['setup_ms_total'] / 1e3:.1f} s CPU ({row['setup_ms_per_unit']:.1f} ms per unit)"
                + (f"; per-rank buffers {_forecast_verdict(row)}" if "memory_vs_forecast" in row else "")
            )
    write_results(print, record, args.json, args.plot, lambda path: _draw(rows, path))
    return 0

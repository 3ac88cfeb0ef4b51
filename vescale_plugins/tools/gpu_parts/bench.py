"""``bench`` parts: ``python -m vescale_plugins.bench``, both engines side by side.

Step time, peak allocated and reserved memory (``max_memory_allocated`` /
``max_memory_reserved``), allocator retries (``num_alloc_retries``), page faults and parity,
per engine. The speed ratio is a claim only at W > 1 on separate GPUs (FSDP2 issues no
collective at W=1); the JSON says which.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import vescale_plugins
from vescale_plugins.tools.gpu_parts.context import PartContext

__all__ = ["bench_env", "run_bench", "run_default", "run_bf16", "run_medium"]

ROOT = Path(vescale_plugins.__file__).resolve().parents[1]
KEEP = (
    "step_ms",
    "tokens_per_s",
    "peak_bytes",
    "cuda_max_allocated_bytes",
    "cuda_max_reserved_bytes",
    "cuda_alloc_retries",
    "page_faults_per_step",
    "sharded_state_bytes",
    "padding_bytes",
)
CUDA_MEMORY = ("cuda_max_allocated_bytes", "cuda_max_reserved_bytes", "cuda_alloc_retries")


def bench_env() -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_bench(args: list[str], timeout_s: float, kind: str) -> dict[str, Any]:
    """``python -m vescale_plugins.bench ARGS``; its summary (ratios, memory, page faults)."""
    env = bench_env()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        command = [sys.executable, "-m", "vescale_plugins.bench", *args, "--json", str(path), "--plot", ""]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command[1:])} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
            )
        data = json.loads(path.read_text())
    summary = data["summary"]
    engines = {name: {k: v for k, v in figures.items() if k in KEEP} for name, figures in summary["engines"].items()}
    for figures in engines.values():
        figures["step_ms"] = {k: v for k, v in figures["step_ms"].items() if k != "samples"}
    parity = summary["parity"]
    if abs(parity["loss"]["fsdp2"] - parity["loss"]["vescale"]) > 1e-3 * max(1.0, abs(parity["loss"]["fsdp2"])):
        raise AssertionError(f"bench losses differ: {parity}")
    if kind == "cuda":
        missing = [(e, k) for e, figures in engines.items() for k in CUDA_MEMORY if k not in figures]
        assert not missing, f"CUDA memory figures missing: {missing}"
    world = data["environment"].get("world_size", 1)
    ratios = summary["ratios"]
    line = f"W={world}: ours/FSDP2 step time {ratios['step_time_paired']:.3f}, peak memory {ratios['peak_memory']:.3f}"
    return {
        "summary": line + ("" if kind == "cuda" and world > 1 else " (no speed claim)"),
        "command": "python -m vescale_plugins.bench " + " ".join(args),
        "environment": data["environment"],
        "ratios": summary["ratios"],
        "speed_claim": kind == "cuda" and world > 1,
        "speed_note": "W=1: FSDP2 issues no collective, the ratio is no speed claim" if world == 1 else "",
        "engines": engines,
        "parity": parity,
    }


def run_default(ctx: PartContext) -> dict[str, Any]:
    """The default model on CUDA; the tiny one on two gloo ranks in the CPU fallback."""
    if ctx.kind != "cuda":
        steps = "2" if ctx.quick else "4"
        tiny = f"--model tiny --world-size 2 --seq-len 32 --warmup 1 --steps {steps} --batch-size 2".split()
        return run_bench(tiny, ctx.timeout_s, ctx.kind)
    return run_bench([], ctx.timeout_s, ctx.kind)


def run_bf16(ctx: PartContext) -> dict[str, Any]:
    return run_bench(["--precision", "bf16-mixed"], ctx.timeout_s, ctx.kind)


def run_medium(ctx: PartContext) -> dict[str, Any]:
    return run_bench(["--model", "medium", "--steps", "12"], ctx.timeout_s, ctx.kind)

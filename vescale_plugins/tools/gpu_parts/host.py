"""``host`` part: ``python -m vescale_plugins.bench host --device cuda`` at W=1 (one NCCL rank).

Main-thread CPU time per phase and wall time per step, ours against FSDP2's and the unsharded
model's, and the kernels each launches per step (the profiler's), fp32 and bf16, on the
bench's tiny Llama (compute negligible: the host decides the step). Off CUDA it is skipped:
the CPU has ``make bench-host`` itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vescale_plugins.tools.gpu_parts.bench import ROOT, bench_env
from vescale_plugins.tools.gpu_parts.context import PartContext

__all__ = ["run"]


def run(ctx: PartContext) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "host.json"
        args = ["host", "--device", "cuda", "--configs", "1:fp32", "1:bf16", "--models", "llama-tiny"]
        command = [sys.executable, "-m", "vescale_plugins.bench", *args, "--json", str(path), "--plot", ""]
        done = subprocess.run(command, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=ctx.timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command[1:])} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
            )
        results = json.loads(path.read_text())["results"]
    figures = {
        r["dtype"]: {
            "ratios": r["summary"],
            "wall_ms_per_step": r["wall_ms_per_step"],
            "kernels_per_step": r["kernels_per_step"],
            "torch": r["torch"],
        }
        for r in results
    }
    fp32 = figures["fp32"]
    line = (
        f"W=1 fp32: CPU ours/FSDP2 {fp32['ratios']['cpu_ratio']:.2f}, own {fp32['ratios']['own_cpu_ratio']:.2f}, "
        f"wall ms {fp32['wall_ms_per_step']['vescale']:.1f} / FSDP2 {fp32['wall_ms_per_step']['fsdp2']:.1f}, "
        f"kernels {fp32['kernels_per_step']['vescale']} / {fp32['kernels_per_step']['fsdp2']}"
    )
    return {"summary": line, "command": "python -m vescale_plugins.bench " + " ".join(args), **figures}

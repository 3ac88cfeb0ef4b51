"""The bench table on a CUDA run shows the allocator's figures beside the peaks: reserved
memory and allocator retries, for both engines."""

from __future__ import annotations

import io

from rich.console import Console

from vescale_plugins.bench.report import render_table


def _engine(retries: int) -> dict:
    return {
        "step_ms": {"median": 10.0, "q1": 9.0, "q3": 11.0},
        "tokens_per_s": 1000.0,
        "page_faults_per_step": None,
        "peak_bytes": 2**30,
        "cuda_max_allocated_bytes": 2**30,
        "cuda_max_reserved_bytes": 2**31,
        "cuda_alloc_retries": retries,
        "sharded_state_bytes": 2**20,
        "padding_bytes": 0,
        "all_gather_bytes_per_step": 2**20,
        "reduce_scatter_bytes_per_step": 2**20,
        "copy_ms_per_step": 0.0,
        "planner_seconds": 0.1,
    }


def test_cuda_table_shows_reserved_memory_and_allocator_retries():
    ratios = dict(step_time=1.0, step_time_paired=1.0, peak_memory=1.0, sharded_state=1.0, padding=1.0)
    summary = {"engines": {"fsdp2": _engine(3), "vescale": _engine(0)}, "ratios": ratios}
    out = io.StringIO()
    Console(file=out, width=200).print(render_table(summary))
    retries = next(line for line in out.getvalue().splitlines() if "CUDA allocator retries" in line)
    assert "3" in retries
    assert "0" in retries
    assert "CUDA max reserved" in out.getvalue()

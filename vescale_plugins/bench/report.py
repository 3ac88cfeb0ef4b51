"""Turn every rank's measurements into figures, a verdict, a table, JSON and a plot.

A step's time is the slowest rank's (the step is done when every rank is). Ratios are
veScale / FSDP2, and veScale / each peer that ran too (Megatron-FSDP 1 and 2, DeepSpeed ZeRO-3). The verdict is honest by
construction: no ratio from runs that did not all complete, and no winner called when the
spread of two engines' step times overlaps.
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch

from vescale_plugins.tools.outputs import pyplot

LABELS = {
    "fsdp2": "FSDP2",
    "vescale": "veScale-FSDP",
    "megatron-fsdp": "Megatron-FSDP",
    "megatron-fsdp-v2": "Megatron-FSDP 2 (exp.)",
    "deepspeed": "DeepSpeed ZeRO-3",
}
SHORT = {
    "fsdp2": "FSDP2",
    "vescale": "veScale",
    "megatron-fsdp": "Megatron",
    "megatron-fsdp-v2": "Megatron 2",
    "deepspeed": "DeepSpeed",
}
COLORS = {
    "fsdp2": "tab:blue",
    "vescale": "tab:orange",
    "megatron-fsdp": "tab:purple",
    "megatron-fsdp-v2": "tab:red",
    "deepspeed": "tab:green",
}


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def _figure(values: list[Any]) -> Any:
    """The largest rank's figure; ``None`` where an engine cannot measure it."""
    return None if None in values else max(values)


def _versus(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> tuple[dict[str, Any], str]:
    """veScale's ratios over engine ``b``, and the verdict."""
    overlap = a["step_ms"]["q1"] <= b["step_ms"]["q3"] and b["step_ms"]["q1"] <= a["step_ms"]["q3"]
    ratio_time = a["step_ms"]["median"] / b["step_ms"]["median"]
    # Each veScale step over the step of ``b`` it was paired with (A B, then B A): less
    # sensitive than the ratio of medians to load that drifts during the run.
    paired = statistics.median(v / f for v, f in zip(a["step_ms"]["samples"], b["step_ms"]["samples"]))
    verdict = (
        "too noisy to call a winner (the step-time IQRs overlap)"
        if overlap
        else (f"{names[0]} is faster" if ratio_time < 1 else f"{names[1]} is faster")
    )
    ratios = {
        "step_time": ratio_time,
        "step_time_paired": paired,
        "peak_memory": a["peak_bytes"] / b["peak_bytes"],
        "sharded_state": a["sharded_state_bytes"] / b["sharded_state_bytes"],
        "padding": (a["padding_bytes"] / b["padding_bytes"]) if b["padding_bytes"] else None,
    }
    return ratios, verdict


def summarize(results: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """Per engine: step-time median and IQR (ms), tokens/s, memory, sharded state, traffic."""
    engines: dict[str, dict[str, Any]] = {}
    for name in results[0]["seconds"]:
        per_step = [max(r["seconds"][name][i] for r in results) for i in range(len(results[0]["seconds"][name]))]
        q1, median, q3 = _quantiles(per_step)
        figures = {k: _figure([r["engines"][name][k] for r in results]) for k in results[0]["engines"][name]}
        # Minor page faults per step: the rank with most, median over steps.
        faults = (
            [max(r["page_faults"][name][i] for r in results) for i in range(len(per_step))]
            if "page_faults" in results[0]
            else []
        )
        engines[name] = {
            "step_ms": {"median": median * 1e3, "q1": q1 * 1e3, "q3": q3 * 1e3, "samples": [s * 1e3 for s in per_step]},
            "page_faults_per_step": statistics.median(faults) if faults else None,
            "tokens_per_s": tokens_per_step / median,
            **figures,
        }
    ratios, verdict = _versus(engines["vescale"], engines["fsdp2"], ("veScale-FSDP", "FSDP2"))
    summary: dict[str, Any] = {
        "engines": engines,
        "ratios": ratios,
        "verdict": verdict,
        "parity": {
            "loss": {name: results[0]["loss"][name] for name in engines},
            "max_param_diff": max(r["max_param_diff"] for r in results),
        },
    }
    # Each peer: veScale's ratios to it, and its distance from FSDP2 (the reference).
    peers = [name for name in engines if name not in ("fsdp2", "vescale")]
    if peers:
        summary["versus"] = {}
        for name in peers:
            ratios, verdict = _versus(engines["vescale"], engines[name], ("veScale-FSDP", LABELS[name]))
            summary["versus"][name] = {"ratios": ratios, "verdict": verdict}
        summary["parity"]["max_param_diff_vs_fsdp2"] = {
            name: max(r["max_param_diff_vs_fsdp2"][name] for r in results) for name in ("vescale", *peers)
        }
    if "step_losses" in results[0]:
        reference = results[0]["step_losses"]["fsdp2"]
        summary["parity"]["max_loss_diff_vs_fsdp2"] = {
            name: max(abs(a - b) for a, b in zip(results[0]["step_losses"][name], reference))
            for name in engines
            if name != "fsdp2"
        }
    return summary


def environment(world: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": "nccl" if cuda else "gloo",
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "world_size": world,
        "cpu_count": os.cpu_count(),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def render_table(summary: dict[str, Any]) -> Any:
    """A rich Table of the figures, the engines side by side, and veScale's ratios to each other engine."""
    from rich.table import Table

    e = summary["engines"]
    ratios = {"fsdp2": summary["ratios"]}
    ratios.update({name: versus["ratios"] for name, versus in summary.get("versus", {}).items()})
    title = " vs ".join(LABELS[name] for name in ("vescale", *(n for n in e if n != "vescale")))
    table = Table(title=f"{title} (same model, data, seed; interleaved steps)")
    table.add_column("figure")
    for name in e:
        table.add_column(LABELS[name], justify="right")
    for name in ratios:
        table.add_column(f"veScale / {SHORT[name]}", justify="right")

    def row(label: str, key: Any, fmt: Any, ratio: Any = None) -> None:
        cells = [fmt(key(figures)) for figures in e.values()]
        shown = ["" if ratio is None or ratio(r) is None else f"{ratio(r):.3f}" for r in ratios.values()]
        table.add_row(label, *cells, *shown)

    def dash(fmt: Any) -> Any:
        return lambda v: "-" if v is None else fmt(v)

    row("step time, median (ms)", lambda x: x["step_ms"]["median"], lambda v: f"{v:.1f}", lambda r: r["step_time"])
    table.add_row(
        "step time, median of paired ratios", *[""] * len(e), *[f"{r['step_time_paired']:.3f}" for r in ratios.values()]
    )
    row("step time, IQR (ms)", lambda x: (x["step_ms"]["q1"], x["step_ms"]["q3"]), lambda v: f"{v[0]:.1f}-{v[1]:.1f}")
    row("tokens/s", lambda x: x["tokens_per_s"], lambda v: f"{v:,.0f}", lambda r: 1 / r["step_time"])
    row(
        "minor page faults per step, median",
        lambda x: x["page_faults_per_step"],
        lambda v: "-" if v is None else f"{v:,.0f}",
    )
    row("peak tensor memory (MiB)", lambda x: x["peak_bytes"], _mib, lambda r: r["peak_memory"])
    if "cuda_max_reserved_bytes" in e["vescale"]:
        row("CUDA max reserved (MiB)", lambda x: x["cuda_max_reserved_bytes"], _mib)
        row("CUDA allocator retries", lambda x: x["cuda_alloc_retries"], lambda v: f"{v:,}")
    row("sharded state per rank (MiB)", lambda x: x["sharded_state_bytes"], _mib, lambda r: r["sharded_state"])
    row("padding per rank (MiB)", lambda x: x["padding_bytes"], _mib, lambda r: r["padding"])
    row("all-gather per step (MiB)", lambda x: x["all_gather_bytes_per_step"], _mib)
    row("reduce-scatter per step (MiB)", lambda x: x["reduce_scatter_bytes_per_step"], _mib)
    row("copy-in/out around collectives (ms/step)", lambda x: x["copy_ms_per_step"], dash(lambda v: f"{v:.2f}"))
    row("planner + sharding time (ms)", lambda x: x["planner_seconds"] * 1e3, lambda v: f"{v:.1f}" if v else "-")
    p = summary.get("parity", {})
    if "max_loss_diff_vs_fsdp2" in p:
        # Parity with FSDP2, the reference: its own column is the reference itself.
        table.add_row("final loss", *[f"{p['loss'][name]:.6f}" for name in e], *[""] * len(ratios))
        losses = p["max_loss_diff_vs_fsdp2"]
        table.add_row(
            "max |loss - FSDP2's|, any step",
            *["-" if name == "fsdp2" else f"{losses[name]:.1e}" for name in e],
            *[""] * len(ratios),
        )
        params = p.get("max_param_diff_vs_fsdp2", {"vescale": p["max_param_diff"]})
        table.add_row(
            "max |param - FSDP2's|, at the end",
            *["-" if name not in params else f"{params[name]:.1e}" for name in e],
            *[""] * len(ratios),
        )
    return table


def parity_line(summary: dict[str, Any]) -> str:
    p = summary["parity"]
    line = f"parity: final loss FSDP2 {p['loss']['fsdp2']:.6f} vs veScale {p['loss']['vescale']:.6f}; max |param diff| {p['max_param_diff']:.2e}"
    for name in summary.get("versus", {}):
        line += f"; {LABELS[name]} final loss {p['loss'][name]:.6f}, max |param diff| vs FSDP2 {p['max_param_diff_vs_fsdp2'][name]:.2e}"
    return line


def write_plot(path: str, summary: dict[str, Any]) -> None:
    """Step times per step (every engine) and peak memory, side by side."""
    plt = pyplot()
    e = summary["engines"]
    fig, (steps_ax, mem_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for name, label in ((name, LABELS[name]) for name in e):
        steps_ax.plot(
            e[name]["step_ms"]["samples"],
            marker="o",
            color=COLORS[name],
            label=f"{label} (median {e[name]['step_ms']['median']:.1f} ms)",
        )
    steps_ax.set_xlabel("measured step")
    steps_ax.set_ylabel("step time (ms, slowest rank)")
    steps_ax.legend()
    steps_ax.set_title(f"step time: ratio {summary['ratios']['step_time']:.3f}")
    mem_ax.bar([SHORT[n] for n in e], [e[n]["peak_bytes"] / 2**20 for n in e], color=[COLORS[n] for n in e])
    mem_ax.set_ylabel("peak tensor memory per rank (MiB)")
    mem_ax.set_title(f"memory: ratio {summary['ratios']['peak_memory']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

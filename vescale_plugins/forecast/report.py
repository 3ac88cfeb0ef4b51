"""The forecast for people: a rich table per world size, JSON, and a PNG."""

from __future__ import annotations

from typing import Any

from vescale_plugins.tools.outputs import pyplot

__all__ = ["MEMORY_PARTS", "render_tables", "write_plot"]

# (key in MemoryBreakdown.to_dict(), row label)
MEMORY_PARTS = (
    ("sharded_params", "sharded parameters"),
    ("sharded_grads", "sharded gradients"),
    ("optimizer_state", "optimizer state"),
    ("unsharded_params", "unsharded parameters (2 units)"),
    ("unsharded_grads", "unsharded gradients (1 unit)"),
    ("comm_buffers", "communication buffers"),
    ("optimizer_transient", "optimizer transient"),
    ("activations", "activations, no checkpointing"),
    ("activations_checkpointed", "activations, checkpointing"),
)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def render_tables(result: dict[str, Any]) -> list[Any]:
    """One ``rich.table.Table`` per world size: memory by part (GiB) and step time (ms)."""
    from rich.table import Table

    ac = result["settings"]["activation_checkpointing"]
    tables = []
    for entry in result["world_sizes"]:
        v, f = entry["engines"]["vescale"], entry["engines"]["fsdp2"]
        hsdp = f", HSDP {entry['replicas']} x {entry['shard_group']}" if entry["replicas"] > 1 else ""
        table = Table(title=f"{result['model']} on {entry['world_size']:,} x {result['hardware']['name']}{hsdp}")
        table.add_column("per rank")
        table.add_column("veScale-FSDP", justify="right")
        table.add_column("FSDP2", justify="right")
        for key, label in MEMORY_PARTS:
            table.add_row(f"{label} (GiB)", _gib(v["memory"][key]), _gib(f["memory"][key]))
        table.add_row(
            "padding (elements)", f"{v['memory']['padding_elements']:,}", f"{f['memory']['padding_elements']:,}"
        )
        label = "with" if ac else "without"
        usable = entry["usable_memory_bytes"]
        table.add_row(
            f"peak, {label} checkpointing (GiB of {_gib(usable)})",
            _gib(v["peak_bytes"]) + (" OOM" if v["oom"] else ""),
            _gib(f["peak_bytes"]) + (" OOM" if f["oom"] else ""),
            style="bold",
        )
        for key, name in (
            ("compute_s", "compute"),
            ("exposed_comm_s", "exposed communication"),
            ("copy_s", "copies"),
            ("optimizer_s", "optimizer"),
            ("all_gather_s", "all-gather (busy)"),
            ("reduce_scatter_s", "reduce-scatter (busy)"),
            ("step_s", "step"),
        ):
            table.add_row(f"{name} (ms)", _ms(v["step"][key]), _ms(f["step"][key]))
        table.add_row(
            "tokens/s per GPU",
            f"{v['step']['tokens_per_s_per_gpu']:,.0f}",
            f"{f['step']['tokens_per_s_per_gpu']:,.0f}",
            style="bold",
        )
        table.caption = f"veScale/FSDP2 throughput {entry['ratios']['throughput']:.3f}, peak memory {entry['ratios']['peak_memory']:.3f}"
        tables.append(table)
    return tables


def write_plot(path: str, result: dict[str, Any]) -> None:
    """Memory by part (stacked bars, both engines side by side) and tokens/s per GPU against
    world size."""
    plt = pyplot()
    ac = result["settings"]["activation_checkpointing"]
    parts = [p for p in MEMORY_PARTS if p[0] != ("activations" if ac else "activations_checkpointed")]
    sizes = [e["world_size"] for e in result["world_sizes"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.38
    colors = plt.get_cmap("tab10")
    for offset, engine, hatch in ((-width / 2, "vescale", ""), (width / 2, "fsdp2", "//")):
        bottoms = [0.0] * len(sizes)
        for k, (key, label) in enumerate(parts):
            heights = [e["engines"][engine]["memory"][key] / 2**30 for e in result["world_sizes"]]
            left.bar(
                [i + offset for i in range(len(sizes))],
                heights,
                width,
                bottom=bottoms,
                color=colors(k),
                hatch=hatch,
                edgecolor="white",
                label=label if engine == "vescale" else None,
            )
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    usable = result["world_sizes"][0]["usable_memory_bytes"] / 2**30
    left.axhline(usable, color="red", linestyle="--", label=f"usable memory ({usable:.0f} GiB)")
    left.set_xticks(range(len(sizes)), [f"{w:,}" for w in sizes])
    left.set_xlabel("GPUs (left bar veScale-FSDP, hatched FSDP2)")
    left.set_ylabel("GiB per rank")
    left.set_yscale("log") if max(
        e["engines"]["fsdp2"]["peak_bytes"] for e in result["world_sizes"]
    ) / 2**30 > 4 * usable else None
    left.set_title(f"{result['model']}: memory per rank by part")
    left.legend(fontsize=7)
    for engine, label, style in (("vescale", "veScale-FSDP", "o-"), ("fsdp2", "FSDP2", "s--")):
        right.plot(
            sizes,
            [e["engines"][engine]["step"]["tokens_per_s_per_gpu"] for e in result["world_sizes"]],
            style,
            label=label,
        )
    right.set_xscale("log", base=2)
    right.set_xlabel("GPUs")
    right.set_ylabel("tokens/s per GPU (forecast)")
    right.set_title(
        f"{result['hardware']['name']}, {result['settings']['precision']}, {result['settings']['optimizer']}"
    )
    right.legend()
    # Fixed margins: tight_layout measures every label's text, 0.4 s of the command's ~6 s.
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.1, top=0.93, wspace=0.2)
    fig.savefig(path, dpi=110)
    plt.close(fig)

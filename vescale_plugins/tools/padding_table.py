"""Padding per rank on the catalogue models: ours against FSDP2's, and split units.

``python -m vescale_plugins.tools.padding_table [--json docs/padding_table.json]`` (or
``vescale-padding-table``) prints two markdown tables and writes the same figures as JSON.
Figures are summed over every unit of the model (embedding, each transformer block, final
norm + head).

1. **Ours against FSDP2** (:func:`fsdp2_rows`), for every catalogue model and ``W`` in
   ``FSDP2_WORLD_SIZES``: the layout ``fully_shard`` plans (:func:`.dbuffer.planning.plan_buffers`,
   bf16 parameters and collectives, its default cost) with no ``block_size_fn`` (rows of dim
   0 where they pad at most FSDP2's, else element-wise) and with ``block_size_fn`` giving 16
   or 128 rows to every parameter of 2 or more dims whose dim 0 they divide; the padding cap
   (``BufferSplitCost(cap_at_fsdp2_padding=True)``) where one-row blocks are asked for; FSDP2's padding (every parameter's dim 0 padded to
   a multiple of ``W``); the planner's lower bound for one buffer per unit; and the modelled
   all-gather time of one forward over every unit (NCCL's model, one collective per buffer,
   FSDP2 one per unit).
2. **One buffer per unit against split units** (:func:`padding_rows`), on the catalogue's
   last-dim rows: **before**, one buffer per unit (:func:`plan_layout`); **after**, the split
   :func:`choose_split` picks under its default NCCL model with no padding cap; **least with
   <= 4 buffers**, whatever the collectives cost.

Padding per rank is in MiB of bf16 (2 bytes per element): ``sum(count * padding) / W``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from vescale_plugins.dbuffer.planning import (
    ALIGNMENT_BYTES,
    BufferSplitCost,
    plan_buffers,
)
from vescale_plugins.dbuffer.planning import (
    planner_inputs as dbuffer_inputs,
)
from vescale_plugins.planner.baselines import fsdp2_padding, megatron_fsdp_padding
from vescale_plugins.planner.bounds import padding_lower_bound
from vescale_plugins.planner.cost import CollectiveCost, choose_split
from vescale_plugins.planner.search import plan_layout
from vescale_plugins.planner.split import unit_plan_options
from vescale_plugins.tools.model_catalog import CATALOG, dim0_block_rows, planner_inputs

__all__ = ["fsdp2_markdown", "fsdp2_rows", "markdown", "padding_rows"]

WORLD_SIZES = (64, 256, 1024)
ROWS_PER_BLOCK = (16, 128)
MAX_BUFFERS = 4
BYTES_PER_ELEMENT = 2
FSDP2_WORLD_SIZES = (64, 1024, 8192)
FSDP2_ROWS_PER_BLOCK = (1, 16, 128)


CAPPED = BufferSplitCost(cap_at_fsdp2_padding=True)


def fsdp2_rows(
    models: Sequence[str] = tuple(CATALOG),
    world_sizes: Sequence[int] = FSDP2_WORLD_SIZES,
    rows_per_block: Sequence[int] = FSDP2_ROWS_PER_BLOCK,
) -> list[dict]:
    """One dict per (model, W, rows per block): payload, our padding and most buffers per
    unit, the single-buffer lower bound, FSDP2's padding (elements), and the modelled
    all-gather seconds of one pass over the units, ours and FSDP2's (module docstring)."""
    cost = CollectiveCost()
    out = []
    for model in (CATALOG[name] for name in models):
        for world in world_sizes:
            for rows in rows_per_block:
                row = dict.fromkeys(("payload", "ours", "capped", "bound", "fsdp2", "megatron"), 0) | {"buffers": 0}
                row |= {"capped_buffers": 0}
                ours_s = capped_s = fsdp2_s = 0.0
                for unit in model.units:
                    shapes = [torch.Size(shape) for _, shape in unit.params]
                    block_rows = dim0_block_rows([s for _, s in unit.params], rows)
                    plans = plan_buffers(shapes, block_rows, torch.bfloat16, torch.bfloat16, world, BufferSplitCost())
                    # The cap where rows are kept: a block_size_fn answering one row each.
                    kept = [1] * len(shapes) if rows == 1 else block_rows
                    capped = plan_buffers(shapes, kept, torch.bfloat16, torch.bfloat16, world, CAPPED)
                    numels, blocks, alignment = dbuffer_inputs(shapes, block_rows, torch.bfloat16)
                    padding = sum(p.layout.padding for p in plans)
                    theirs = fsdp2_padding(shapes, [n // s[0] for n, s in zip(numels, shapes)], world)
                    row["payload"] += unit.count * sum(numels)
                    row["ours"] += unit.count * padding
                    row["bound"] += unit.count * padding_lower_bound(numels, blocks, world, alignment=alignment)
                    row["fsdp2"] += unit.count * theirs
                    row["megatron"] += unit.count * _megatron_padding(shapes, rows, world)
                    row["buffers"] = max(row["buffers"], len(plans))
                    row["capped"] += unit.count * sum(p.layout.padding for p in capped)
                    row["capped_buffers"] = max(row["capped_buffers"], len(capped))
                    ours_s += unit.count * cost.unit_seconds([p.layout for p in plans], BYTES_PER_ELEMENT)
                    capped_s += unit.count * cost.unit_seconds([p.layout for p in capped], BYTES_PER_ELEMENT)
                    fsdp2_s += unit.count * cost.seconds((sum(numels) + theirs) * BYTES_PER_ELEMENT, world)
                out.append(
                    {
                        "model": model.name,
                        "world_size": world,
                        "rows_per_block": rows,
                        "payload_elements": row["payload"],
                        "padding_elements": row["ours"],
                        "max_buffers_per_unit": row["buffers"],
                        "single_buffer_bound_elements": row["bound"],
                        "fsdp2_padding_elements": row["fsdp2"],
                        "megatron_fsdp_padding_elements": row["megatron"],
                        "all_gather_s": ours_s,
                        "capped_padding_elements": row["capped"],
                        "capped_max_buffers_per_unit": row["capped_buffers"],
                        "capped_all_gather_s": capped_s,
                        "fsdp2_all_gather_s": fsdp2_s,
                    }
                )
    return out


def _megatron_padding(shapes: Sequence[torch.Size], rows: int, world: int) -> int:
    """Megatron-FSDP's padding of one unit (:func:`.planner.baselines.megatron_fsdp_padding`,
    checked against megatron-fsdp's own layout): its chunk is the least common multiple of the
    tensors' rows (dims after 0), times ``rows`` where those rows are kept in blocks."""
    kept = dim0_block_rows(shapes, rows)
    blocks = [(k or 1) * (s[1:].numel() if len(s) > 1 else 1) for s, k in zip(shapes, kept)]
    return megatron_fsdp_padding([s.numel() for s in shapes], blocks, world)


def fsdp2_markdown(rows: list[dict]) -> str:
    """The table of :func:`fsdp2_rows`: padding % of the payload per (model, W)."""
    cost = CollectiveCost()
    by_key = {(r["model"], r["world_size"], r["rows_per_block"]): r for r in rows}
    models = list(dict.fromkeys(r["model"] for r in rows))
    worlds = list(dict.fromkeys(r["world_size"] for r in rows))
    granularities = sorted({r["rows_per_block"] for r in rows})
    blocked = [g for g in granularities if g != 1]
    lines = [
        "Padding per rank as % of the payload, every unit of the model, bf16 parameters and "
        f"collectives ({ALIGNMENT_BYTES}-byte aligned: 8 elements). Ours: the layout `fully_shard` "
        "plans (buffers: the most one unit gets; with no blocks, rows of dim 0 where they pad at most "
        "FSDP2's plus 512 bytes per rank and under 1 % of the unit or 1 MiB over all ranks, else cut "
        "element-wise). FSDP2: every parameter's dim 0 padded to a "
        "multiple of W (FSDP2 cannot keep blocks whole; its figure is the same for every "
        "granularity). Bound: the least padding of one buffer per unit with those blocks. "
        "All-gather ms: one forward's all-gathers over every unit under NCCL's model "
        f"(`CollectiveCost()`: {cost.gpus_per_node} GPUs per node, ring), ours one per buffer, "
        "FSDP2 one per unit. Capped: one-row blocks asked for (`block_size_fn` answering 1: rows "
        "kept) with `BufferSplitCost(cap_at_fsdp2_padding=True)`, splitting units where that keeps "
        "their padding at most FSDP2's. Megatron-FSDP: its layout (each shard a multiple of the least "
        "common multiple of the unit's row sizes; with blocks, of rows x row size), with no blocks / "
        "then each block size.",
        "",
        "| model | W | FSDP2 % | ours, no blocks % (buffers) | all-gather ms, ours / FSDP2 | "
        "one-row blocks capped % (buffers) / all-gather ms | "
        + " | ".join(f"ours, {g}-row % (buffers) / bound %" for g in blocked)
        + " | Megatron-FSDP % "
        + " / ".join(["no blocks", *(f"{g}-row" for g in blocked)])
        + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(blocked) + 1),
    ]
    for model in models:
        for world in worlds:
            plain = by_key[(model, world, 1)]
            payload = plain["payload_elements"]

            def pct(elements: int, payload: int = payload) -> str:
                return f"{100 * elements / payload:.4f}"

            cells = [
                model,
                str(world),
                pct(plain["fsdp2_padding_elements"]),
                f"{pct(plain['padding_elements'])} ({plain['max_buffers_per_unit']})",
                f"{1e3 * plain['all_gather_s']:.0f} / {1e3 * plain['fsdp2_all_gather_s']:.0f}",
                f"{pct(plain['capped_padding_elements'])} ({plain['capped_max_buffers_per_unit']}) / "
                f"{1e3 * plain['capped_all_gather_s']:.0f}",
            ]
            for g in blocked:
                r = by_key[(model, world, g)]
                cells.append(
                    f"{pct(r['padding_elements'])} ({r['max_buffers_per_unit']}) / "
                    f"{pct(r['single_buffer_bound_elements'])}"
                )
            cells.append(
                " / ".join(pct(by_key[(model, world, g)]["megatron_fsdp_padding_elements"]) for g in granularities)
            )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def padding_rows(
    models: Sequence[str] = tuple(CATALOG),
    rows_per_block: Sequence[int] = ROWS_PER_BLOCK,
    world_sizes: Sequence[int] = WORLD_SIZES,
) -> list[dict]:
    """One dict per (model, rows per block, W): payload and padding elements, per rank
    MiB, and the buffer counts (see the module docstring)."""
    rows_out = []
    for model in (CATALOG[name] for name in models):
        for rows in rows_per_block:
            for world in world_sizes:
                payload = before = after = least = 0
                after_buffers = 0
                for unit in model.units:
                    numels, blocks = planner_inputs(unit, rows)
                    chosen = choose_split(numels, blocks, world, max_buffers=MAX_BUFFERS)
                    options = unit_plan_options(numels, blocks, world)
                    payload += unit.count * sum(numels)
                    before += unit.count * plan_layout(numels, blocks, world).padding
                    after += unit.count * chosen.padding
                    least += unit.count * options[min(MAX_BUFFERS, len(options)) - 1].padding
                    after_buffers = max(after_buffers, len(chosen.buffers))
                rows_out.append(
                    {
                        "model": model.name,
                        "rows_per_block": rows,
                        "world_size": world,
                        "payload_elements": payload,
                        "before_padding_elements": before,
                        "after_padding_elements": after,
                        "after_max_buffers_per_unit": after_buffers,
                        "least_padding_elements_max4": least,
                        "before_mib_per_rank": _mib_per_rank(before, world),
                        "after_mib_per_rank": _mib_per_rank(after, world),
                        "least_mib_per_rank_max4": _mib_per_rank(least, world),
                    }
                )
    return rows_out


def _mib_per_rank(elements: int, world: int) -> float:
    return elements * BYTES_PER_ELEMENT / world / 2**20


def markdown(rows: list[dict]) -> str:
    """The table: MiB of padding per rank, with % of the payload in brackets."""
    lines = [
        "Padding per rank in MiB of bf16 (and % of the payload), every unit of the model, "
        "blocks of k last-dim rows. Before: one buffer per unit. After: the split "
        "`choose_split` picks under NCCL's model (`CollectiveCost()`, no padding cap), with "
        f"the most buffers it uses in one unit. Least: the least padding with at most "
        f"{MAX_BUFFERS} buffers per unit, whatever the collectives cost.",
        "",
        "| model | rows/block | W | before MiB (%) | after MiB (%) | buffers/unit | least, <= 4 buffers, MiB (%) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        payload = row["payload_elements"]

        def cell(mib: float, elements: int) -> str:
            return f"{mib:.2f} ({100 * elements / payload:.2f})"

        lines.append(
            f"| {row['model']} | {row['rows_per_block']} | {row['world_size']} | "
            f"{cell(row['before_mib_per_rank'], row['before_padding_elements'])} | "
            f"{cell(row['after_mib_per_rank'], row['after_padding_elements'])} | "
            f"{row['after_max_buffers_per_unit']} | "
            f"{cell(row['least_mib_per_rank_max4'], row['least_padding_elements_max4'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    against = fsdp2_rows()
    rows = padding_rows()
    print("### Ours against FSDP2\n")
    print(fsdp2_markdown(against))
    print("\n### One buffer per unit against split units\n")
    print(markdown(rows))
    print(f"\n_Generated by `python -m vescale_plugins.tools.padding_table` in {time.perf_counter() - start:.1f} s._")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "world_sizes": list(WORLD_SIZES),
                    "rows_per_block": list(ROWS_PER_BLOCK),
                    "cost_model": dataclasses.asdict(CollectiveCost()),
                    "rows": rows,
                    "fsdp2_world_sizes": list(FSDP2_WORLD_SIZES),
                    "fsdp2_rows_per_block": list(FSDP2_ROWS_PER_BLOCK),
                    "fsdp2_rows": against,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()

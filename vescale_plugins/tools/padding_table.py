"""Padding per rank on the catalogue models, one buffer per unit against split units.

``python -m vescale_plugins.tools.padding_table [--json docs/padding_table.json]`` (or
``vescale-padding-table``) prints
a markdown table and writes the same figures as JSON. For every catalogue model, world size
``W`` in ``WORLD_SIZES`` and block granularity in ``ROWS_PER_BLOCK``, summed over the
model's units (embedding, each transformer block, final norm + head):

* **before**: one buffer per unit (:func:`plan_layout`), the runtime's layout so far;
* **after**: the split :func:`choose_split` picks under the default alpha-beta ring model
  (10 us per ring step, 100 GB/s, bf16), and the largest buffer count it uses in a unit;
* **least with <= 4 buffers**: the least padding any plan with at most 4 buffers per unit
  reaches (``unit_plan_options``), whatever its collective cost.

Padding per rank is in MiB of bf16 (2 bytes per element): ``sum(count * padding) / W``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

from vescale_plugins.planner.cost import RingCost, choose_split
from vescale_plugins.planner.search import plan_layout
from vescale_plugins.planner.split import unit_plan_options
from vescale_plugins.tools.model_catalog import CATALOG, planner_inputs

__all__ = ["padding_rows", "markdown"]

WORLD_SIZES = (64, 256, 1024)
ROWS_PER_BLOCK = (16, 128)
MAX_BUFFERS = 4
BYTES_PER_ELEMENT = 2


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
    cost = RingCost()
    lines = [
        f"Padding per rank in MiB of bf16 (and % of the payload), every unit of the model. "
        f"Before: one buffer per unit. After: the split `choose_split` picks with "
        f"alpha = {cost.alpha_s * 1e6:.0f} us per ring step and beta = "
        f"{cost.beta_bytes_per_s / 1e9:.0f} GB/s (an extra buffer must save "
        f"{cost.break_even_elements() / 1e3:.0f}K elements per rank), with the most buffers "
        f"it uses in one unit. Least: the least padding with at most {MAX_BUFFERS} buffers "
        "per unit, whatever the collectives cost.",
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
    rows = padding_rows()
    print(markdown(rows))
    print(f"\n_Generated by `python -m vescale_plugins.tools.padding_table` in {time.perf_counter() - start:.1f} s._")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "world_sizes": list(WORLD_SIZES),
                    "rows_per_block": list(ROWS_PER_BLOCK),
                    "cost_model": dataclasses.asdict(RingCost()),
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()

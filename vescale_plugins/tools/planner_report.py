"""Padding, bounds and planning time of the layout planner on real model shapes.

Run ``python -m vescale_plugins.tools.planner_report`` (or ``vescale-planner-report``; under
ten seconds); it prints markdown to stdout:

1. One table per block granularity (1, 16, 128 rows): for every catalogue model and world
   size, the single-buffer padding against the lower bound, the planning time, and what
   FSDP2, flat element-wise sharding and Megatron-FSDP pay on the same units.
2. The buffer-splitting trade-off: padding with at most 1-4 buffers per unit and the cost
   model's choice.
3. The targets, checked; planning times; the comparison with the exact optimum on small
   random instances.

Padding % is padding elements over payload elements, summed over every unit of the model
(embedding, each transformer block, final norm + head). The FSDP unit is one transformer block.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

from vescale_plugins.planner import CollectiveCost, choose_split, clear_plan_cache, plan_layout, unit_plan_options
from vescale_plugins.planner.baselines import flat_padding_and_cut_blocks, fsdp2_padding, megatron_fsdp_padding
from vescale_plugins.planner.exact import exact_min_shard_size
from vescale_plugins.planner.split_bounds import split_padding_lower_bound
from vescale_plugins.tools.model_catalog import CATALOG, ModelUnits, planner_inputs

WORLD_SIZES = (8, 64, 256, 1024, 8192, 16384)
GRANULARITIES = (1, 16, 128)
SPLIT_BUDGETS = (1, 2, 3, 4)
RANDOM_INSTANCES = 1500
# The planner's targets: single-buffer gap to the bound (percentage points) per granularity.
BOUND_GAP_TARGET_PP = {1: 1.0, 16: 1.0, 128: 3.0}


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}"


@dataclass
class SingleBuffer:
    """One (model, world size, granularity) cell, summed over the model's units (elements)."""

    payload: int = 0
    padding: int = 0
    bound: int = 0
    # What the others pad on the same units: "fsdp2", "flat" (element-wise), "megatron".
    baselines: Counter[str] = field(default_factory=Counter)
    cut_blocks: int = 0  # blocks element-wise sharding cuts across ranks
    worst_gap_pp: float = 0.0
    seconds: float = 0.0


@dataclass
class Split:
    """The buffer-splitting cell: padding by buffer budget and the cost model's pick."""

    payload: int
    by_budget: list[int]
    chosen: int
    chosen_buffers: int
    seconds: float


def single_buffer(model: ModelUnits, world_size: int, rows: int) -> SingleBuffer:
    """Plan every unit of ``model`` from a cold cache (identical blocks planned once)."""
    cell = SingleBuffer()
    clear_plan_cache()
    for unit in model.units:
        numels, blocks = planner_inputs(unit, rows)
        start = time.perf_counter()
        for _ in range(unit.count):
            layout = plan_layout(numels, blocks, world_size)
        cell.seconds += time.perf_counter() - start
        cell.payload += unit.count * sum(numels)
        cell.padding += unit.count * layout.padding
        cell.bound += unit.count * layout.padding_lower_bound
        gap = 100 * (layout.padding_ratio - layout.padding_lower_bound_ratio)
        cell.worst_gap_pp = max(cell.worst_gap_pp, gap)
        shapes = [shape for _, shape in unit.params]
        flat, cut = flat_padding_and_cut_blocks(numels, blocks, world_size)
        cell.baselines["fsdp2"] += unit.count * fsdp2_padding(shapes, blocks, world_size)
        cell.baselines["flat"] += unit.count * flat
        cell.baselines["megatron"] += unit.count * megatron_fsdp_padding(numels, blocks, world_size)
        cell.cut_blocks += unit.count * cut
    return cell


def split(model: ModelUnits, world_size: int, rows: int) -> Split:
    """Best padding per buffer budget, and the default cost model's choice, per unit."""
    clear_plan_cache()
    cell = Split(0, [0] * len(SPLIT_BUDGETS), 0, 0, 0.0)
    for unit in model.units:
        numels, blocks = planner_inputs(unit, rows)
        start = time.perf_counter()
        options = unit_plan_options(numels, blocks, world_size)
        plan = choose_split(numels, blocks, world_size)
        cell.seconds += time.perf_counter() - start
        cell.payload += unit.count * sum(numels)
        for k, budget in enumerate(SPLIT_BUDGETS):
            cell.by_budget[k] += unit.count * options[min(budget, len(options)) - 1].padding
        cell.chosen += unit.count * plan.padding
        cell.chosen_buffers = max(cell.chosen_buffers, len(plan.buffers))
    return cell


def split_bound_percent(model: ModelUnits, world_size: int, rows: int) -> float:
    """The least padding % any split into at most 4 buffers per unit can have
    (``split_padding_lower_bound``, summed over the model's units)."""
    payload = bound = 0
    for unit in model.units:
        numels, blocks = planner_inputs(unit, rows)
        payload += unit.count * sum(numels)
        bound += unit.count * split_padding_lower_bound(numels, blocks, world_size, max_buffers=SPLIT_BUDGETS[-1])
    return 100 * bound / payload


def single_buffer_table(rows: int, cells: dict) -> list[str]:
    lines = [
        f"### Single buffer per unit, {rows}-row blocks",
        "",
        "| model | W | padding % | lower bound % | worst unit gap (pp) | plan ms | "
        "FSDP2 % | flat % (blocks cut) | Megatron-FSDP % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in CATALOG.values():
        for world_size in WORLD_SIZES:
            c = cells[rows, model.name, world_size]
            lines.append(
                f"| {model.name} | {world_size} | {percent(c.padding, c.payload)} | "
                f"{percent(c.bound, c.payload)} | {c.worst_gap_pp:.2f} | "
                f"{1000 * c.seconds:.1f} | {percent(c.baselines['fsdp2'], c.payload)} | "
                f"{percent(c.baselines['flat'], c.payload)} ({c.cut_blocks}) | "
                f"{percent(c.baselines['megatron'], c.payload)} |"
            )
    return lines + [""]


def split_table(rows: int, cells: dict) -> list[str]:
    budgets = " | ".join(f"<= {k} buf %" for k in SPLIT_BUDGETS)
    lines = [
        f"### Buffer splitting, {rows}-row blocks",
        "",
        f"| model | W | {budgets} | cost model picks (max buffers/unit, %) | plan ms |",
        "|---|---:|" + "---:|" * len(SPLIT_BUDGETS) + "---|---:|",
    ]
    for model in CATALOG.values():
        for world_size in WORLD_SIZES:
            c = cells[rows, model.name, world_size]
            budget_cells = " | ".join(percent(p, c.payload) for p in c.by_budget)
            lines.append(
                f"| {model.name} | {world_size} | {budget_cells} | {c.chosen_buffers}, "
                f"{percent(c.chosen, c.payload)} | {1000 * c.seconds:.0f} |"
            )
    return lines + [""]


def target_lines(singles: dict, splits: dict) -> list[str]:
    """The planner's quality targets, checked cell by cell."""
    lines = ["### Targets", ""]
    for rows, target in BOUND_GAP_TARGET_PP.items():
        gaps = [(c.worst_gap_pp, key) for key, c in singles.items() if key[0] == rows]
        worst, (_, model, world) = max(gaps)
        met = sum(gap <= target for gap, _ in gaps)
        lines.append(
            f"- Single buffer, {rows}-row blocks: every unit within {target:.0f} pp of its "
            f"bound in {met}/{len(gaps)} (model, W) cells; worst unit gap {worst:.2f} pp "
            f"({model}, W={world})."
        )
    for rows in (1, 16):
        below = [key for key, c in splits.items() if key[0] == rows and 100 * c.by_budget[-1] < c.payload]
        cells = [key for key in splits if key[0] == rows]
        missed = sorted(set(cells) - set(below), key=lambda k: (k[1], k[2]))
        proven = {key: split_bound_percent(CATALOG[key[1]], key[2], rows) for key in missed}
        out_of_reach = [key for key in missed if proven[key] >= 1.0]
        open_cells = [key for key in missed if proven[key] < 1.0]
        lines.append(
            f"- Splitting, {rows}-row blocks: below 1 % with at most {SPLIT_BUDGETS[-1]} "
            f"buffers per unit in {len(below)}/{len(cells)} cells. Proven out of reach for "
            f"any split into at most {SPLIT_BUDGETS[-1]} buffers (bound on the padding, "
            f"planned %): "
            + (
                ", ".join(
                    f"{m} W={w} (>= {proven[r, m, w]:.2f} %, "
                    f"{percent(splits[r, m, w].by_budget[-1], splits[r, m, w].payload)} %)"
                    for r, m, w in out_of_reach
                )
                or "none"
            )
            + ". Open (neither reached nor proven; bound, planned %): "
            + (
                ", ".join(
                    f"{m} W={w} ({proven[r, m, w]:.2f} %, "
                    f"{percent(splits[r, m, w].by_budget[-1], splits[r, m, w].payload)} %)"
                    for r, m, w in open_cells
                )
                or "none"
            )
            + "."
        )
    return lines + [""]


def timing_lines() -> list[str]:
    """The timing targets: a 70B model at W=1024, and the slowest unit at W=8192."""
    model = CATALOG["Llama-3-70B"]
    clear_plan_cache()
    start = time.perf_counter()
    for unit in model.units:
        numels, blocks = planner_inputs(unit, 1)
        for _ in range(unit.count):
            plan_layout(numels, blocks, 1024)
    cached = time.perf_counter() - start
    start = time.perf_counter()
    for unit in model.units:
        numels, blocks = planner_inputs(unit, 1)
        for _ in range(unit.count):
            clear_plan_cache()
            plan_layout(numels, blocks, 1024)
    uncached = time.perf_counter() - start
    slowest, slowest_name = 0.0, ""
    for rows in GRANULARITIES:
        for model_units in CATALOG.values():
            for unit in model_units.units:
                numels, blocks = planner_inputs(unit, rows)
                clear_plan_cache()
                start = time.perf_counter()
                plan_layout(numels, blocks, 8192)
                elapsed = time.perf_counter() - start
                if elapsed > slowest:
                    slowest, slowest_name = elapsed, f"{model_units.name} {unit.name}, {rows}-row"
    return [
        "### Planning time",
        "",
        f"- Llama-3-70B, every unit, W=1024: {1000 * cached:.1f} ms from a cold cache "
        f"(identical blocks planned once), {1000 * uncached:.1f} ms planning all "
        f"{sum(u.count for u in model.units)} units from scratch.",
        f"- Slowest single unit at W=8192, any model and granularity: {1000 * slowest:.1f} ms ({slowest_name}).",
        "",
    ]


def random_instance(rng: random.Random) -> tuple[list[int], list[int], int, int]:
    count = rng.randint(1, 6)
    blocks = [rng.choice((1, 2, 3, 4, 5, 6, 7, 8, 12, 16)) for _ in range(count)]
    numels = [block * rng.randint(1, 12) for block in blocks]
    return numels, blocks, rng.choice((1, 2, 3, 4, 5, 7, 8, 16)), rng.choice((1, 1, 2, 4))


def exhaustive_lines() -> list[str]:
    """How the planner compares with the exact optimum on small random instances."""
    rng = random.Random(2602)
    optimal, worst, worst_case = 0, 1.0, None
    for _ in range(RANDOM_INSTANCES):
        numels, blocks, world_size, alignment = random_instance(rng)
        planned = plan_layout(numels, blocks, world_size, alignment=alignment).shard_size
        best = exact_min_shard_size(numels, blocks, world_size, alignment=alignment)
        optimal += planned == best
        if planned / best > worst:
            worst = planned / best
            worst_case = (numels, blocks, world_size, alignment, planned, best)
    lines = [
        "### Against the exact optimum",
        "",
        f"{RANDOM_INSTANCES} random instances (1-6 tensors, block sizes 1-16, W in 1-16, "
        f"alignment 1-4; exhaustive search over orders and shard sizes): the planner's shard "
        f"size is optimal in {100 * optimal / RANDOM_INSTANCES:.1f} % of them; worst ratio "
        f"to the optimum {worst:.3f}.",
    ]
    if worst_case is not None:
        numels, blocks, world_size, alignment, planned, best = worst_case
        lines.append(
            f"Worst case: numels {numels}, blocks {blocks}, W={world_size}, "
            f"alignment {alignment}: shard {planned} vs optimum {best}."
        )
    return lines + [""]


def main() -> None:
    start = time.perf_counter()
    keys = [(rows, model, world) for rows in GRANULARITIES for model in CATALOG for world in WORLD_SIZES]
    singles = {key: single_buffer(CATALOG[key[1]], key[2], key[0]) for key in keys}
    splits = {key: split(CATALOG[key[1]], key[2], key[0]) for key in keys}
    cost = CollectiveCost()
    out = [
        "## Planner report",
        "",
        "Padding % = padding elements / payload elements over every unit of the model; "
        "the lower bound is the least padding any single buffer per unit can have. "
        f"Split cost model: NCCL's tuner model (`CollectiveCost`, docs/planner.md): ring "
        f"{cost.base_latency_s * 1e6:.1f} us + {cost.intra_step_s * 1e6:.1f} us per NVLink step + "
        f"{cost.inter_step_s * 1e6:.0f} us per network step, {cost.gpus_per_node} GPUs per node, "
        f"{cost.inter_bandwidth / 1e9:.0f} GB/s across nodes, 2 bytes per "
        "element. Plan ms: the whole model from a cold cache.",
        "",
    ]
    out += target_lines(singles, splits)
    out += timing_lines()
    out += exhaustive_lines()
    for rows in GRANULARITIES:
        out += single_buffer_table(rows, singles)
    for rows in GRANULARITIES:
        out += split_table(rows, splits)
    out.append(
        f"_Generated by `python -m vescale_plugins.tools.planner_report` in {time.perf_counter() - start:.1f} s._"
    )
    print("\n".join(out))


if __name__ == "__main__":
    main()

"""Each engine's layout of one FSDP unit at one group size, from the code that makes it.

veScale-FSDP: the planner's :class:`~vescale_plugins.planner.Layout`, asked exactly as
``DBuffer`` asks it (one buffer per unit: every parameter here is floating point and
trainable; blocks of ``block_rows`` dim-0 rows; 16-byte aligned offsets). FSDP2: its
``Shard(0)`` rule, every parameter padded to ``ceil(dim0 / n)`` rows per rank
(:func:`vescale_plugins.planner.baselines.fsdp2_padding`). Sizes in elements.

Identical units share one plan: a model's layers are planned once per group size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from vescale_plugins.planner import Layout, plan_layout
from vescale_plugins.planner.baselines import fsdp2_padding
from vescale_plugins.tools.model_catalog import Unit

__all__ = ["UnitLayouts", "dbuffer_alignment", "dbuffer_block_sizes", "plan_unit_layouts", "rank_payloads"]

# DBuffer aligns offsets to 16 bytes (vescale_plugins/dbuffer.py, _ALIGNMENT_BYTES).
_ALIGNMENT_BYTES = 16


def dbuffer_alignment(sharded_itemsize: int) -> int:
    """The planner alignment (elements) DBuffer uses for sharded parameters of this itemsize."""
    return max(1, _ALIGNMENT_BYTES // sharded_itemsize)


def _slice_numel(shape: Sequence[int]) -> int:
    """Elements in one dim-0 row (a 0-d or 1-d parameter's row is one element)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def dbuffer_block_sizes(shapes: Sequence[Sequence[int]], block_rows: int | None) -> list[int]:
    """Block sizes (elements) as ``fully_shard`` plans them: one dim-0 row, or ``block_rows``
    rows for a parameter of 2 or more dims whose dim 0 they divide (the bench's
    ``--block-rows`` rule)."""
    sizes = []
    for shape in shapes:
        rows = block_rows if block_rows and len(shape) >= 2 and shape[0] % block_rows == 0 else 1
        sizes.append(rows * _slice_numel(shape))
    return sizes


@dataclass(frozen=True)
class UnitLayouts:
    """One unit at group size ``group_size``: veScale-FSDP's layout and FSDP2's padding.

    ``fsdp2_shard_elements`` is what every FSDP2 rank allocates for the unit (the padded
    ``ceil(dim0 / n)`` rows of each parameter), ``(payload + fsdp2_padding) / n``.
    """

    group_size: int
    vescale: Layout
    fsdp2_padding: int
    fsdp2_shard_elements: int
    fsdp2_rank0_param_elements: tuple[int, ...]

    @property
    def payload(self) -> int:
        return sum(self.vescale.numels)


@functools.lru_cache(maxsize=4096)
def _plan(
    shapes: tuple[tuple[int, ...], ...], group_size: int, block_rows: int | None, sharded_itemsize: int
) -> UnitLayouts:
    numels = [max(1, math.prod(s)) for s in shapes]
    layout = plan_layout(
        numels, dbuffer_block_sizes(shapes, block_rows), group_size, alignment=dbuffer_alignment(sharded_itemsize)
    )
    as_rows = [s if len(s) else (1,) for s in shapes]
    padding = fsdp2_padding(as_rows, [_slice_numel(s) for s in as_rows], group_size)
    rank0 = tuple(-(-s[0] // group_size) * _slice_numel(s) for s in as_rows)
    return UnitLayouts(group_size, layout, padding, (sum(numels) + padding) // group_size, rank0)


def plan_unit_layouts(
    unit: Unit, group_size: int, block_rows: int | None = None, sharded_itemsize: int = 4
) -> UnitLayouts:
    """Both engines' layouts of ``unit`` sharded over ``group_size`` ranks (cached)."""
    return _plan(tuple(tuple(s) for _, s in unit.params), group_size, block_rows, sharded_itemsize)


def rank_payloads(layout: Layout, weights: Sequence[float] | None = None) -> list[float]:
    """Per rank, the weighted count of parameter elements (padding excluded) it holds:
    ``sum over tensors t of weights[t] * |t's elements in the rank's shard|`` (weights of 1
    count elements). One pass over tensors and ranks: O(tensors + ranks)."""
    shard, world = layout.shard_size, layout.world_size
    weights = weights if weights is not None else [1.0] * len(layout.numels)
    # Difference array of the weight per element, integrated per rank below.
    full = [0.0] * (world + 1)  # per-rank weight of tensors covering the whole shard
    partial = [0.0] * world
    for index, weight in enumerate(weights):
        start, stop = layout.tensor_slice(index)
        first, last = start // shard, (stop - 1) // shard
        if first == last:
            partial[first] += weight * (stop - start)
            continue
        partial[first] += weight * ((first + 1) * shard - start)
        partial[last] += weight * (stop - last * shard)
        full[first + 1] += weight
        full[last] -= weight
    payloads, running = [], 0.0
    for rank in range(world):
        running += full[rank]
        payloads.append(running * shard + partial[rank])
    return payloads

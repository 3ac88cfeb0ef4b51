"""Each engine's layout of one FSDP unit at one group size, from the code that makes it.

veScale-FSDP: the buffers :func:`vescale_plugins.dbuffer.planning.plan_buffers` gives the
unit, asked exactly as ``fully_shard`` asks (one group: every parameter here is floating point
and trainable; blocks of ``block_rows`` dim-0 rows where they divide dim 0, elsewhere no block
asked, so rows or element-wise as ``plan_buffers`` decides; the default split cost). FSDP2: its ``Shard(0)`` rule, every parameter padded to ``ceil(dim0 / n)`` rows per
rank (:func:`vescale_plugins.planner.baselines.fsdp2_padding`). Sizes in elements.

Identical units share one plan: a model's layers are planned once per group size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vescale_plugins.dbuffer.planning import BufferPlan, plan_buffers, row_numel
from vescale_plugins.planner import Layout
from vescale_plugins.planner.baselines import fsdp2_padding
from vescale_plugins.tools.model_catalog import Unit, dim0_block_rows

__all__ = ["UnitLayouts", "buffer_rank_payloads", "plan_unit_layouts", "rank_payloads"]

_DTYPES = {2: torch.bfloat16, 4: torch.float32}


@dataclass(frozen=True)
class UnitLayouts:
    """One unit at group size ``group_size``: veScale-FSDP's buffers and FSDP2's padding.

    ``vescale_buffers``: each DBuffer's parameter positions and layout. ``fsdp2_shard_elements``
    is what every FSDP2 rank allocates for the unit (the padded ``ceil(dim0 / n)`` rows of
    each parameter), ``(payload + fsdp2_padding) / n``.
    """

    group_size: int
    vescale_buffers: tuple[BufferPlan, ...]
    fsdp2_padding: int
    fsdp2_shard_elements: int
    fsdp2_rank0_param_elements: tuple[int, ...]

    @property
    def payload(self) -> int:
        return sum(sum(b.layout.numels) for b in self.vescale_buffers)

    @property
    def vescale_layouts(self) -> tuple[Layout, ...]:
        return tuple(b.layout for b in self.vescale_buffers)

    @property
    def vescale_shard_elements(self) -> int:
        """Elements per rank over the unit's buffers."""
        return sum(b.layout.shard_size for b in self.vescale_buffers)

    @property
    def vescale_padding(self) -> int:
        return sum(b.layout.padding for b in self.vescale_buffers)


@functools.lru_cache(maxsize=4096)
def _plan(
    shapes: tuple[tuple[int, ...], ...],
    group_size: int,
    block_rows: int | None,
    sharded_itemsize: int,
    compute_itemsize: int,
) -> UnitLayouts:
    buffers = plan_buffers(
        [torch.Size(s) for s in shapes],
        dim0_block_rows(shapes, block_rows),
        _DTYPES[sharded_itemsize],
        _DTYPES[compute_itemsize],
        group_size,
    )
    numels = [max(1, math.prod(s)) for s in shapes]
    as_rows = [s if len(s) else (1,) for s in shapes]
    padding = fsdp2_padding(as_rows, [row_numel(s) for s in as_rows], group_size)
    rank0 = tuple(-(-s[0] // group_size) * row_numel(s) for s in as_rows)
    return UnitLayouts(group_size, tuple(buffers), padding, (sum(numels) + padding) // group_size, rank0)


def plan_unit_layouts(
    unit: Unit,
    group_size: int,
    block_rows: int | None = None,
    sharded_itemsize: int = 4,
    compute_itemsize: int | None = None,
) -> UnitLayouts:
    """Both engines' layouts of ``unit`` sharded over ``group_size`` ranks (cached);
    ``compute_itemsize`` (default: the sharded one) is what the collectives move."""
    compute = sharded_itemsize if compute_itemsize is None else compute_itemsize
    return _plan(tuple(tuple(s) for _, s in unit.params), group_size, block_rows, sharded_itemsize, compute)


def buffer_rank_payloads(layouts: UnitLayouts, weights: Sequence[float]) -> list[float]:
    """:func:`rank_payloads` over the unit's buffers, ``weights`` per parameter of the unit."""
    totals = [0.0] * layouts.group_size
    for buffer in layouts.vescale_buffers:
        for rank, value in enumerate(rank_payloads(buffer.layout, [weights[i] for i in buffer.positions])):
            totals[rank] += value
    return totals


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

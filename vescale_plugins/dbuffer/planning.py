"""The one place DBuffers get their layouts: what the planner is asked for a group of
parameters, and how many buffers the group is split into.

Each DBuffer costs its own all-gather and reduce-scatter, so a group is split only where the
padding saved outweighs the extra collectives' latency under the alpha-beta ring model
(:func:`vescale_plugins.planner.choose_split`): an extra buffer must save
``alpha * beta / bytes`` elements per rank (500K at the defaults, 10 us per ring step and
100 GB/s). Small units and small world sizes keep one buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vescale_plugins.planner import Layout, RingCost, choose_split

__all__ = ["ALIGNMENT_BYTES", "BufferPlan", "BufferSplitCost", "plan_buffers", "planner_inputs", "row_numel"]

# Collectives and vectorised kernels like 16-byte aligned buffers; offsets are in elements.
ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class BufferSplitCost:
    """The ring model's parameters (``alpha_s`` seconds per ring step, ``beta_bytes_per_s``)
    and the most buffers one (mesh, dtype, requires_grad) group may get. ``fully_shard``
    takes one (``buffer_split_cost=``); the same on every rank."""

    alpha_s: float = RingCost.alpha_s
    beta_bytes_per_s: float = RingCost.beta_bytes_per_s
    max_buffers: int = 4

    def __post_init__(self) -> None:
        RingCost(self.alpha_s, self.beta_bytes_per_s)  # validates alpha and beta
        if not isinstance(self.max_buffers, int) or self.max_buffers < 1:
            raise ValueError(f"max_buffers must be an int >= 1, got {self.max_buffers!r}")


@dataclass(frozen=True)
class BufferPlan:
    """One DBuffer of a group: the positions of its parameters in the group (ascending) and
    its layout."""

    positions: tuple[int, ...]
    layout: Layout


def row_numel(shape: torch.Size) -> int:
    return math.prod(shape[1:]) if len(shape) > 0 else 1


def planner_inputs(
    shapes: Sequence[torch.Size], block_rows: Sequence[int], dtype: torch.dtype
) -> tuple[list[int], list[int], int]:
    """What the planner is asked for these parameters: numels, block sizes and alignment, in
    elements (``ALIGNMENT_BYTES`` of ``dtype``). A zero-size parameter (FSDP2 accepts them)
    is planned as one element that holds nothing."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numels = [max(1, math.prod(s)) for s in shapes]
    blocks = [rows * row_numel(s) if len(s) and math.prod(s) else 1 for s, rows in zip(shapes, block_rows)]
    return numels, blocks, max(1, ALIGNMENT_BYTES // itemsize)


def plan_buffers(
    shapes: Sequence[torch.Size],
    block_rows: Sequence[int],
    dtype: torch.dtype,
    comm_dtype: torch.dtype,
    world_size: int,
    cost: BufferSplitCost = BufferSplitCost(),
) -> list[BufferPlan]:
    """The group's buffers, ordered by their first parameter. ``comm_dtype`` is what the
    collectives move (the cost model counts its bytes)."""
    numels, blocks, alignment = planner_inputs(shapes, block_rows, dtype)
    # Each rank's chunk of the gather starts at a multiple of the shard size: aligned in the
    # gathered dtype too (an fp32 shard gathered in bf16 needs twice the elements).
    alignment = max(alignment, ALIGNMENT_BYTES // torch.empty((), dtype=comm_dtype).element_size())
    plan = choose_split(
        numels,
        blocks,
        world_size,
        alpha_s=cost.alpha_s,
        beta_bytes_per_s=cost.beta_bytes_per_s,
        bytes_per_element=torch.empty((), dtype=comm_dtype).element_size(),
        alignment=alignment,
        max_buffers=cost.max_buffers,
    )
    return [BufferPlan(tuple(members), layout) for members, layout in zip(plan.members, plan.buffers)]

"""How many DBuffers a unit's (dtype, requires_grad) group gets: the planner's split under
the alpha-beta ring cost model (:func:`vescale_plugins.planner.choose_split`).

Each DBuffer costs its own all-gather and reduce-scatter, so a group is split only where the
padding saved outweighs the extra collectives' latency: an extra buffer must save
``alpha * beta / bytes`` elements per rank (500K at the defaults, 10 us per ring step and
100 GB/s). Small units and small world sizes keep one buffer. The cost is process-wide and
read when a unit is built (``fully_shard``): set it first, identically on every rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch

from vescale_plugins.dbuffer.buffer import planner_inputs
from vescale_plugins.planner import Layout, RingCost, choose_split

__all__ = ["BufferSplitCost", "buffer_split_cost", "split_group", "use_buffer_split_cost"]


@dataclass(frozen=True)
class BufferSplitCost:
    """The ring model's parameters (``alpha_s`` seconds per ring step, ``beta_bytes_per_s``)
    and the most buffers one group may get."""

    alpha_s: float = RingCost.alpha_s
    beta_bytes_per_s: float = RingCost.beta_bytes_per_s
    max_buffers: int = 4

    def __post_init__(self) -> None:
        RingCost(self.alpha_s, self.beta_bytes_per_s)  # validates alpha and beta
        if not isinstance(self.max_buffers, int) or self.max_buffers < 1:
            raise ValueError(f"max_buffers must be an int >= 1, got {self.max_buffers!r}")


_cost = BufferSplitCost()


def buffer_split_cost() -> BufferSplitCost:
    """The cost units built now use."""
    return _cost


@contextlib.contextmanager
def use_buffer_split_cost(**changes: float | int) -> Iterator[BufferSplitCost]:
    """Build units under another cost, e.g. ``use_buffer_split_cost(alpha_s=0.0)`` (split
    wherever it saves padding) or ``max_buffers=1`` (never split)."""
    global _cost
    previous, _cost = _cost, replace(_cost, **changes)
    try:
        yield _cost
    finally:
        _cost = previous


def split_group(shapes: Sequence[torch.Size], block_rows: Sequence[int], dtype: torch.dtype,
                comm_dtype: torch.dtype, world_size: int) -> list[tuple[tuple[int, ...], Layout]]:
    """The group's buffers: positions in ``shapes`` (ascending) and each buffer's layout,
    ordered by their first parameter. ``comm_dtype`` is what the collectives move."""
    numels, blocks, alignment = planner_inputs(shapes, block_rows, dtype)
    cost = _cost
    plan = choose_split(
        numels, blocks, world_size, alpha_s=cost.alpha_s, beta_bytes_per_s=cost.beta_bytes_per_s,
        bytes_per_element=torch.empty((), dtype=comm_dtype).element_size(), alignment=alignment,
        max_buffers=cost.max_buffers,
    )
    return list(zip(plan.members, plan.buffers))

"""The exact optimum of the single-buffer problem, by exhaustive search over orders.

Exponential: only for small instances (a handful of tensors), where it measures how far the
heuristic in :mod:`.search` is from optimal. Exact because, for a fixed order and shard size,
earliest-start placement is optimal (see :mod:`.placement`), so a shard size is feasible iff
some order of the tensors fits. Every multiple of the alignment is scanned upward from the
plain volume bound, deliberately not from :mod:`.bounds`' sharper one, so that comparing the
two tests the sharper bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vescale_plugins.planner.bounds import aligned_payload, round_up
from vescale_plugins.planner.layout import check_plan_inputs
from vescale_plugins.planner.packing import earliest_start

__all__ = ["exact_min_shard_size"]

MAX_EXACT_TENSORS = 8


def exact_min_shard_size(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1
) -> int:
    """The smallest shard size (elements per rank) of any valid single-buffer layout.

    Raises ``ValueError`` beyond ``MAX_EXACT_TENSORS`` tensors (the search is factorial).
    """
    numels, block_sizes = check_plan_inputs(numels, block_sizes, world_size, alignment)
    if len(numels) > MAX_EXACT_TENSORS:
        raise ValueError(f"exhaustive search is for at most {MAX_EXACT_TENSORS} tensors, got {len(numels)}")
    by_volume = -(-aligned_payload(numels, alignment) // world_size)
    shard = round_up(max(by_volume, max(block_sizes)), alignment)
    # Identical tensors are interchangeable: search orders of distinct (numel, block) kinds.
    kinds: dict[tuple[int, int], int] = {}
    for key in zip(numels, block_sizes):
        kinds[key] = kinds.get(key, 0) + 1
    items = [(numel, block, math.lcm(alignment, block), count) for (numel, block), count in kinds.items()]
    while not _some_order_fits(items, shard, world_size, alignment):
        # Terminates: at shard >= the aligned payload everything fits in rank 0.
        shard += alignment
    return shard


def _some_order_fits(items: list[tuple[int, int, int, int]], shard: int, world_size: int, alignment: int) -> bool:
    """Depth-first search over orders of the kinds, pruned by the payload still to place."""
    limit = world_size * shard
    counts = [count for *_, count in items]
    remaining = aligned_payload([numel for numel, _, _, count in items for _ in range(count)], alignment)

    def extend(cursor: int, remaining: int) -> bool:
        if remaining == 0:
            return True
        for kind, (numel, block, step, _) in enumerate(items):
            if not counts[kind]:
                continue
            start = earliest_start(cursor, numel, shard, alignment, step, shard % block == 0)
            if start is None or start + numel > limit:
                continue
            footprint = round_up(numel, alignment)
            if round_up(start + numel, alignment) + remaining - footprint > limit:
                continue
            counts[kind] -= 1
            found = extend(start + numel, remaining - footprint)
            counts[kind] += 1
            if found:
                return True
        return False

    return extend(0, remaining)

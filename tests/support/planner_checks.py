"""Layouts checked from first principles, independently of the planner's own code.

Every check is recomputed here (intervals, rank boundaries, blocks) so that a bug in
:class:`Layout`'s self-check cannot hide a bug in the planner; brute force answers what the
optimum is on tiny instances.
"""

from __future__ import annotations

import itertools

from vescale_plugins.planner import Layout, plan_layout, shard_size_lower_bound


def assert_valid(layout: Layout) -> None:
    """The four structural guarantees, recomputed from scratch."""
    shard, world = layout.shard_size, layout.world_size
    assert shard >= 1
    assert shard % layout.alignment == 0
    intervals = sorted((layout.offsets[i], layout.offsets[i] + layout.numels[i], i) for i in range(len(layout.numels)))
    previous_end = 0
    for start, stop, index in intervals:
        assert start % layout.alignment == 0, f"tensor {index} misaligned"
        assert start >= previous_end, f"tensor {index} overlaps"
        previous_end = stop
        block = layout.block_sizes[index]
        for boundary in range((start // shard + 1) * shard, stop, shard):
            assert (boundary - start) % block == 0, f"tensor {index} block cut at {boundary}"
    assert previous_end <= world * shard
    assert layout.padding == world * shard - sum(layout.numels) >= 0
    for index, numel in enumerate(layout.numels):
        assert_rank_views(layout, index, numel)


def assert_rank_views(layout: Layout, index: int, numel: int) -> None:
    """Per-rank ranges tile the tensor in rank order; units are whole blocks."""
    block = layout.block_sizes[index]
    ranges, units = layout.shard_ranges(index), layout.local_units(index)
    assert len(ranges) == len(units) == layout.world_size
    covered = layout.offsets[index]
    for rank, ((start, length), count) in enumerate(zip(ranges, units)):
        holds_end = length and rank * layout.shard_size + start + length == layout.offsets[index] + numel
        # Whole blocks, except that the rank holding the tensor's end may end on the short one.
        assert length == count * block or (holds_end and 0 < count * block - length < block)
        if length:
            assert rank * layout.shard_size + start == covered
            assert start + length <= layout.shard_size
            covered += length
        else:
            assert start == 0
    assert covered == layout.offsets[index] + numel
    assert sum(units) == -(-numel // block)


def assert_unit_plan_valid(plan, numels, blocks) -> None:
    """Every tensor in exactly one buffer, where it is the tensor asked for; every buffer valid."""
    seen = sorted(i for members in plan.members for i in members)
    assert seen == list(range(len(numels)))
    for index in range(len(numels)):
        layout, slot = plan.layout_of(index)
        assert plan.members[plan.buffer_of[index]][slot] == index
        assert (layout.numels[slot], layout.block_sizes[slot]) == (numels[index], blocks[index])
    for layout in plan.buffers:
        assert_valid(layout)


def plan_above_the_bound(problem) -> Layout:
    """``plan_layout`` of a ``(numels, blocks, world, alignment)`` problem; its shard is at
    least the shard-size lower bound."""
    numels, blocks, world, alignment = problem
    layout = plan_layout(numels, blocks, world, alignment=alignment)
    assert layout.shard_size >= shard_size_lower_bound(numels, blocks, world, alignment=alignment)
    return layout


def start_is_valid(start: int, numel: int, block: int, shard: int, alignment: int) -> bool:
    """The definition: aligned, and every rank boundary inside the tensor is a block edge."""
    boundaries = range((start // shard + 1) * shard, start + numel, shard)
    return start % alignment == 0 and all((b - start) % block == 0 for b in boundaries)


def brute_force_fits(numels, blocks, world, alignment, shard) -> bool:
    """Some order and some start positions (not only the earliest) fit the buffer."""
    limit = world * shard

    def place(order, cursor):
        if not order:
            return True
        index, rest = order[0], order[1:]
        for start in range(cursor, limit - numels[index] + 1):
            if start_is_valid(start, numels[index], blocks[index], shard, alignment):
                if place(rest, start + numels[index]):
                    return True
        return False

    return any(place(order, 0) for order in itertools.permutations(range(len(numels))))


def brute_force_min_shard(numels, blocks, world, alignment) -> int:
    """The smallest aligned shard size some placement fits in."""
    shard = alignment
    while not brute_force_fits(numels, blocks, world, alignment, shard):
        shard += alignment
    return shard

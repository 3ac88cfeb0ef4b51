"""Block sizes that do not divide a tensor: the last block is shorter, and still whole.

A tensor of R rows in blocks of g rows is ceil(R / g) blocks counted from its start; a rank
boundary may fall inside it only on a multiple of g rows from its start. Checked from first
principles (every boundary, every block) and against brute force on small instances.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.planner_checks import brute_force_min_shard, plan_above_the_bound, start_is_valid
from vescale_plugins.planner import CollectiveCost, choose_split, plan_layout
from vescale_plugins.planner.exact import exact_min_shard_size
from vescale_plugins.planner.packing import earliest_start

PROPERTY = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)


def assert_no_block_straddles_a_rank(layout, numels, blocks) -> None:
    """Every block (the last one short) lies inside one rank's shard; tensors tile in order."""
    shard = layout.shard_size
    ends = []
    for index, (numel, block) in enumerate(zip(numels, blocks)):
        start = layout.offsets[index]
        for block_start in range(start, start + numel, block):
            block_end = min(block_start + block, start + numel)
            assert block_start // shard == (block_end - 1) // shard, (index, block_start, block_end, shard)
        ranges = layout.shard_ranges(index)
        assert sum(length for _, length in ranges) == numel
        assert sum(layout.local_units(index)) == -(-numel // min(block, numel))
        ends.append((start, start + numel))
    ends.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
    assert ends[-1][1] <= layout.world_size * shard


@st.composite
def ragged_problems(draw, max_tensors: int = 8):
    count = draw(st.integers(1, max_tensors))
    world = draw(st.one_of(st.integers(1, 16), st.sampled_from([64, 97, 1024])))
    alignment = draw(st.sampled_from([1, 1, 2, 4, 16]))
    row = draw(st.sampled_from([1, 3, 32, 384]))
    blocks = [row * draw(st.sampled_from([1, 7, 32, 128])) for _ in range(count)]
    numels = [row * draw(st.one_of(st.integers(1, 300), st.integers(1, 10**5))) for _ in range(count)]
    return numels, blocks, world, alignment


@PROPERTY
@given(ragged_problems())
def test_no_block_straddles_a_rank_when_blocks_do_not_divide(problem):
    numels, blocks, _, _ = problem
    assert_no_block_straddles_a_rank(plan_above_the_bound(problem), numels, blocks)


@settings(PROPERTY, max_examples=60)
@given(ragged_problems(max_tensors=5))
def test_split_plans_keep_short_blocks_whole(problem):
    numels, blocks, world, alignment = problem
    # No latency: a split wherever it saves padding.
    free = CollectiveCost(base_latency_s=0.0, intra_step_s=0.0, inter_step_s=0.0)
    plan = choose_split(numels, blocks, world, cost=free, alignment=alignment, max_buffers=3)
    for index in range(len(numels)):
        layout, slot = plan.layout_of(index)
        start = layout.offsets[slot]
        for boundary in range(
            (start // layout.shard_size + 1) * layout.shard_size, start + numels[index], layout.shard_size
        ):
            assert (boundary - start) % blocks[index] == 0


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_1031_rows_in_32_row_tiles(world):
    """The issue's example: a (1031, 384) weight is 32 tiles of 32 rows and one of 7."""
    rows, cols = 1031, 384
    layout = plan_layout([rows * cols, 384, 384 * 1031], [32 * cols, 1024, 32 * 1031], world, alignment=4)
    assert_no_block_straddles_a_rank(layout, [rows * cols, 384, 384 * 1031], [32 * cols, 384, 32 * 1031])
    row_starts = [start // cols for start, length in layout.shard_ranges(0) if length]
    assert all(r % 32 == 0 for r in row_starts[1:] or [0])


@settings(PROPERTY, max_examples=60)
@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(1, 20)), min_size=1, max_size=3),
    st.integers(1, 6),
    st.sampled_from([1, 2, 3]),
)
def test_planner_bound_and_exact_optimum_against_brute_force(tensors, world, alignment):
    blocks = [b for b, _ in tensors]
    numels = [n for _, n in tensors]
    optimum = brute_force_min_shard(numels, [min(b, n) for b, n in tensors], world, alignment)
    assert exact_min_shard_size(numels, blocks, world, alignment=alignment) == optimum
    layout = plan_layout(numels, blocks, world, alignment=alignment)
    assert layout.shard_size_lower_bound <= optimum <= layout.shard_size <= 2 * optimum


@settings(PROPERTY, max_examples=300)
@given(st.integers(0, 60), st.integers(1, 40), st.integers(1, 8), st.integers(1, 12), st.sampled_from([1, 2, 3]))
def test_earliest_start_with_a_short_last_block(cursor, numel, block, shard, alignment):
    shard *= alignment
    step = math.lcm(block, alignment)
    found = earliest_start(cursor, numel, shard, alignment, step, shard % block == 0)
    valid = [s for s in range(cursor, cursor + 4 * shard + numel) if start_is_valid(s, numel, block, shard, alignment)]
    assert found == (valid[0] if valid else None)

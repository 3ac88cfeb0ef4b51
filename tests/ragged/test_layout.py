"""The pure layout arithmetic behind RaggedShard: slices, local shapes, boxes, bad input."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vescale_plugins import RaggedShard, flat_interval_boxes, ragged_layout


def test_row_wise_uneven_units_with_a_zero():
    layout = ragged_layout((7, 3), (0,), (3, 0, 4))
    assert [(s.offset, s.length, s.local_shape) for s in layout.slices] == [
        (0, 9, (3, 3)),
        (9, 0, (0, 3)),
        (9, 12, (4, 3)),
    ]
    assert layout.row_numel == 3
    assert layout.block_rows == 1


def test_element_wise_shards_are_one_dimensional():
    layout = ragged_layout((4, 5), (0, 1), (1, 3))
    assert [(s.offset, s.length, s.local_shape) for s in layout.slices] == [(0, 5, (5,)), (5, 15, (15,))]


def test_block_wise_unit_of_two_rows_keeps_trailing_dims():
    layout = ragged_layout((8, 2, 3), (0,), (1, 2, 1))
    assert [s.local_shape for s in layout.slices] == [(2, 2, 3), (4, 2, 3), (2, 2, 3)]


def test_partial_prefix_flattens_leading_dims_into_rows():
    layout = ragged_layout((2, 3, 4), (0, 1), (1, 2))
    assert [s.local_shape for s in layout.slices] == [(2, 4), (4, 4)]


def test_whole_tensor_on_one_rank():
    layout = ragged_layout((3, 4), (), (0, 1, 0))
    assert [s.local_shape for s in layout.slices] == [(0, 4), (3, 4), (0, 4)]
    assert [s.length for s in layout.slices] == [0, 12, 0]


@pytest.mark.parametrize(
    ("shape", "dims", "units", "message"),
    [
        ((4, 4), (1,), (1, 1), "dims must be a prefix"),
        ((4, 4), (0, 2), (1, 1), "dims must be a prefix"),
        ((4, 4), (0,), (1, -1), "non-negative"),
        ((4, 4), (0,), (0, 0), "all zero"),
        ((4, 4), (0,), (), "local_units is empty"),
        ((5, 4), (0,), (1, 1), "sum(local_units) must divide the 5 rows"),
        ((4, 3), (0,), (1, 2, 5), "do not split into 8 equal blocks"),
        ((4,), (0, 1), (1,), "the tensor has only 1"),
        ((3, 4), (), (1, 1), "do not split into 2 equal blocks"),
    ],
)
def test_bad_layout_names_shape_dims_units_and_what_fits(shape, dims, units, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        ragged_layout(shape, dims, units)
    text = str(info.value)
    assert message in text
    assert f"dims={tuple(dims)}" in text
    assert f"local_units={tuple(units)}" in text


def test_placement_constructor_rejects_bad_arguments_without_a_shape():
    with pytest.raises(ValueError, match="dims must be a prefix"):
        RaggedShard((1,), (1, 1))
    with pytest.raises(ValueError, match="all zero"):
        RaggedShard((0,), (0, 0))


def test_placement_equality_and_hash_include_units():
    assert RaggedShard((0,), (1, 2)) == RaggedShard([0], [1, 2])
    assert RaggedShard((0,), (1, 2)) != RaggedShard((0,), (2, 1))
    assert RaggedShard((0,), (1, 2)) != RaggedShard((0, 1), (1, 2))
    assert len({RaggedShard((0,), (1, 2)), RaggedShard((0,), (1, 2)), RaggedShard((0,), (2, 1))}) == 2


@st.composite
def shapes_and_units(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    k = draw(st.integers(1, ndim))
    rows = math.prod(shape[:k])
    divisors = [d for d in range(1, rows + 1) if rows % d == 0]
    total = draw(st.sampled_from(divisors))
    world = draw(st.integers(1, 5))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    units = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    return shape, tuple(range(k)), tuple(units)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(shapes_and_units())
def test_slices_tile_the_storage_in_rank_order(case):
    shape, dims, units = case
    layout = ragged_layout(shape, dims, units)
    full = torch.arange(math.prod(shape)).view(shape)
    pieces = []
    for rank, s in enumerate(layout.slices):
        local = RaggedShard(dims, units).split_full(full, rank)
        assert tuple(local.shape) == s.local_shape
        assert local.numel() == s.length
        pieces.append(local.reshape(-1))
    assert torch.equal(torch.cat(pieces), full.reshape(-1))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_boxes_cover_an_interval_exactly_in_storage_order(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    length = data.draw(st.integers(0, numel - start))
    full = torch.arange(numel).view(shape)
    boxes = flat_interval_boxes(shape, start, length)
    assert len(boxes) <= 2 * len(shape) - 1 or length == 0
    covered = [full[tuple(slice(o, o + n) for o, n in zip(off, size))].reshape(-1) for off, size in boxes]
    got = torch.cat(covered) if covered else torch.empty(0, dtype=full.dtype)
    assert torch.equal(got, torch.arange(start, start + length))

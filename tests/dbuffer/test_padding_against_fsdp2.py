"""Padding per rank against FSDP2's on every catalogue model at W = 64, 1024 and 8192.

Ours: the buffers ``fully_shard`` plans (``plan_buffers``, bf16 parameters and collectives):
by default (one buffer per unit, rows where they pad no more than FSDP2, else element-wise),
and with the split cost's padding cap on. FSDP2's: computed as FSDP2 computes it, with its
own helper. No processes: the planner and meta tensors only.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from vescale_plugins.dbuffer.planning import BufferSplitCost, is_elementwise, plan_buffers, planner_inputs
from vescale_plugins.planner import padding_lower_bound
from vescale_plugins.tools.model_catalog import CATALOG, dim0_block_rows

WORLD_SIZES = (64, 1024, 8192)
ALIGNMENT = 8  # elements: 16 bytes of bf16
SLACK = 256  # elements per rank: the 512 bytes (one CUDA allocator block) the cap allows


@functools.cache
def fsdp2_padding(shape: tuple[int, ...], world: int) -> int:
    """FSDP2's padding of one parameter: ``FSDPParam._init_sharded_param`` chunks dim 0 over
    the ranks (``_chunk_with_empty``: ``torch.chunk``, the list then filled up with empty
    tensors) and pads every rank to chunk 0's size (torch 2.13,
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py:304,
    ``padded_sharded_size = chunks[0].size()  # 0th always padded``)."""
    param = torch.empty(shape, device="meta")
    first = torch.chunk(param, world, dim=0)[0]
    return world * first.numel() - param.numel()


CAPPED = BufferSplitCost(cap_at_fsdp2_padding=True)


def plan(shapes: list[tuple[int, ...]], rows: int | None, world: int, cost: BufferSplitCost = CAPPED):
    """``rows`` None: no block_size_fn; 1: a block_size_fn answering one row for every
    parameter (kept in rows); else the bench's ``--block-rows``."""
    sizes = [torch.Size(s) for s in shapes]
    block_rows = [1] * len(shapes) if rows == 1 else dim0_block_rows(shapes, rows)
    return plan_buffers(sizes, block_rows, torch.bfloat16, torch.bfloat16, world, cost)


# (One-row blocks asked for, the cap on.) The one cell where the planner finds no split into
# at most 4 buffers at FSDP2's padding
# (six buffers reach it; the bound on 4-buffer splits is 0): DeepSeek-V3's MoE layer at
# W=64 pads 48896 elements (764 per rank, 0.0004 % of the layer) where FSDP2 pads none.
PLANNER_GAPS = {("DeepSeek-V3-671B", "moe_decoder_layer", 64): 48896}


@pytest.mark.parametrize("model", sorted(CATALOG))
@pytest.mark.parametrize(
    ("rows", "cost"), [(None, BufferSplitCost()), (1, CAPPED)], ids=["default", "one-row-blocks-capped"]
)
def test_padding_with_no_block_size_fn_is_at_most_fsdp2s(model, rows, cost):
    # Per model: at most FSDP2's, plus the 16-byte alignment FSDP2 does not do (a - 1
    # elements before each tensor and per rank at each buffer's end) and 512 bytes per rank
    # per unit (below the allocator's granularity); at most 1 % wherever FSDP2's is. By
    # default (no block_size_fn) in one buffer per unit: no more collectives than FSDP2's one
    # per unit. With one-row blocks asked for (rows kept), the padding cap meets it by splits.
    default = rows is None
    for world in WORLD_SIZES:
        payload = ours = theirs = allowance = 0
        for unit in CATALOG[model].units:
            shapes = [shape for _, shape in unit.params]
            buffers = plan(shapes, rows, world, cost)
            assert not default or len(buffers) == 1, (model, unit.name, world, len(buffers))
            padding = sum(b.layout.padding for b in buffers)
            gap = 0 if default else PLANNER_GAPS.get((model, unit.name, world), 0)
            assert gap == 0 or padding == gap, (model, unit.name, world, padding)
            payload += unit.count * sum(math.prod(s) for s in shapes)
            ours += unit.count * (padding - gap)
            theirs += unit.count * sum(fsdp2_padding(s, world) for s in shapes)
            allowance += unit.count * ((ALIGNMENT - 1) * (len(shapes) + len(buffers) * world) + SLACK * world)
        assert ours <= theirs + allowance, (model, world, ours / payload, theirs / payload)
        if theirs <= 0.01 * payload:
            assert ours <= 0.01 * payload, (model, world, ours / payload)
        # By default also where FSDP2 pads more: rows that waste memory are given up.
        assert not default or ours <= 0.01 * payload, (model, world, ours / payload, theirs / payload)


def _cut_elementwise(buffers, shapes) -> list[bool]:
    """Per parameter (in the unit's order): whether the plan cut it element-wise."""
    cut = [False] * len(shapes)
    for b in buffers:
        for slot, position in enumerate(b.positions):
            cut[position] = is_elementwise(torch.Size(shapes[position]), b.layout.block_sizes[slot])
    return cut


def test_rows_stay_where_they_pad_no_more_than_fsdp2():
    # Where one buffer of whole rows already pads at most FSDP2's (+ the slack), the default
    # plan is today's row-wise one (2-D local shards, FSDP2's Shard(0) shapes); elsewhere the
    # parameters nothing asks rows of are cut element-wise. Explicit block_size_fn answers
    # (even 1 row) stay rows.
    shapes = [shape for _, shape in next(u for u in CATALOG["Llama-3-8B"].units if u.name == "decoder_layer").params]
    sizes = [torch.Size(s) for s in shapes]
    for world, elementwise in ((2, False), (1024, True)):
        default = plan(shapes, None, world, BufferSplitCost())
        rows = plan_buffers(sizes, [1] * len(sizes), torch.bfloat16, torch.bfloat16, world, BufferSplitCost())
        assert not any(_cut_elementwise(rows, shapes))
        assert _cut_elementwise(default, shapes) == [elementwise and len(s) >= 2 for s in shapes], world
        if not elementwise:
            assert [(b.positions, b.layout) for b in default] == [(b.positions, b.layout) for b in rows]
    # The same in a mixed group: the 1-D norms and block-asked weights keep their rows.
    asked = [16 if len(s) >= 2 and i % 2 else None for i, s in enumerate(shapes)]
    mixed = plan_buffers(sizes, asked, torch.bfloat16, torch.bfloat16, 1024, BufferSplitCost())
    cut = _cut_elementwise(mixed, shapes)
    assert not any(c for c, r in zip(cut, asked) if r is not None)


def test_rows_that_waste_memory_are_cut_elementwise_even_where_fsdp2_pads_more():
    # GPT-OSS-120B's fused experts (fewer rows than ranks) at W=1024 and Llama-3-8B's block
    # at W=8192: whole rows pad less than FSDP2's Shard(0) does (so the FSDP2 criterion alone
    # keeps them), but more than 1 % of the unit and MiBs over the job. The default cuts them
    # element-wise; a small unit at a few ranks that pads a few rows keeps them.
    cases = [("GPT-OSS-120B", 1024), ("Llama-3-8B", 8192)]
    for model, world in cases:
        for unit in CATALOG[model].units:
            shapes = [shape for _, shape in unit.params]
            sizes = [torch.Size(s) for s in shapes]
            rows = plan_buffers(sizes, [1] * len(sizes), torch.bfloat16, torch.bfloat16, world, BufferSplitCost())
            rows_padding = sum(b.layout.padding for b in rows)
            theirs = sum(fsdp2_padding(s, world) for s in shapes)
            payload = sum(math.prod(s) for s in shapes)
            if not (0.01 * payload < rows_padding <= theirs):
                continue
            default = plan(shapes, None, world, BufferSplitCost())
            assert len(default) == 1, (model, unit.name)
            assert any(_cut_elementwise(default, shapes)), (model, unit.name)
            assert default[0].layout.padding <= 0.01 * payload, (model, unit.name, default[0].layout.padding)
            break
        else:
            raise AssertionError(f"{model} at W={world}: no unit whose rows pad 1-100 % of FSDP2's waste")
    small = [torch.Size((6, 250)), torch.Size((5, 330))]  # rows pad 1 row at W=4, 4 % of a few KiB
    default = plan_buffers(small, [None, None], torch.float32, torch.float32, 4, BufferSplitCost())
    explicit = plan_buffers(small, [1, 1], torch.float32, torch.float32, 4, BufferSplitCost())
    assert [(b.positions, b.layout) for b in default] == [(b.positions, b.layout) for b in explicit]


def test_a_dense_block_at_1024_ranks_is_cut_elementwise_in_one_buffer():
    # Llama-3-8B's block at W=1024: one buffer of whole rows pads 6.8 % (a shard both row
    # lengths tile); FSDP2 pads nothing. With no block_size_fn the default keeps one buffer
    # and cuts the weights element-wise (the cap then has nothing to split); with one-row
    # blocks asked for, the cap splits it in three.
    shapes = [shape for _, shape in next(u for u in CATALOG["Llama-3-8B"].units if u.name == "decoder_layer").params]
    sizes = [torch.Size(s) for s in shapes]
    assert sum(fsdp2_padding(s, 1024) for s in shapes) == 0
    rows = plan_buffers(sizes, [1] * len(sizes), torch.bfloat16, torch.bfloat16, 1024, BufferSplitCost())
    assert len(rows) == 1
    assert rows[0].layout.padding_ratio > 0.06
    default = plan(shapes, None, 1024, BufferSplitCost())
    assert len(default) == 1
    assert default[0].layout.padding <= 7 * (len(shapes) + 1024)
    assert [(b.positions, b.layout) for b in plan(shapes, None, 1024)] == [(b.positions, b.layout) for b in default]
    capped = plan(shapes, 1, 1024)
    assert len(capped) == 3
    assert sum(b.layout.padding for b in capped) <= 7 * (len(shapes) + 3 * 1024)


@pytest.mark.parametrize("rows", [16, 128])
def test_blocks_stay_within_one_point_of_the_bound(rows):
    # With blocks asked for, FSDP2 is no reference (it cannot keep them whole): the split
    # chosen pads at most one point of the payload above the single-buffer lower bound.
    for model in CATALOG.values():
        for world in WORLD_SIZES:
            payload = ours = bound = 0
            for unit in model.units:
                shapes = [shape for _, shape in unit.params]
                sizes = [torch.Size(s) for s in shapes]
                numels, blocks, alignment = planner_inputs(sizes, dim0_block_rows(shapes, rows), torch.bfloat16)
                payload += unit.count * sum(numels)
                ours += unit.count * sum(b.layout.padding for b in plan(shapes, rows, world))
                bound += unit.count * padding_lower_bound(numels, blocks, world, alignment=alignment)
            assert ours <= bound + 0.01 * payload, (model.name, world, rows, ours / payload, bound / payload)

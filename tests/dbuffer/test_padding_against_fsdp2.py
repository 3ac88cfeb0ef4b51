"""Padding per rank against FSDP2's on every catalogue model at W = 64, 1024 and 8192.

Ours: the buffers ``fully_shard`` plans (``plan_buffers``, bf16 parameters and collectives,
the split cost with the padding cap on). FSDP2's: computed as FSDP2 computes it, with its own helper. No
processes: the planner and meta tensors only.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from vescale_plugins.dbuffer.planning import BufferSplitCost, plan_buffers, planner_inputs
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


def plan(shapes: list[tuple[int, ...]], rows: int, world: int, cost: BufferSplitCost = CAPPED):
    sizes = [torch.Size(s) for s in shapes]
    return plan_buffers(sizes, dim0_block_rows(shapes, rows), torch.bfloat16, torch.bfloat16, world, cost)


# The one cell where the planner finds no split into at most 4 buffers at FSDP2's padding
# (six buffers reach it; the bound on 4-buffer splits is 0): DeepSeek-V3's MoE layer at
# W=64 pads 48896 elements (764 per rank, 0.0004 % of the layer) where FSDP2 pads none.
PLANNER_GAPS = {("DeepSeek-V3-671B", "moe_decoder_layer", 64): 48896}


@pytest.mark.parametrize("model", sorted(CATALOG))
def test_padding_with_no_block_size_fn_is_at_most_fsdp2s(model):
    # Per model: at most FSDP2's, plus the 16-byte alignment FSDP2 does not do (a - 1
    # elements before each tensor and per rank at each buffer's end) and 512 bytes per rank
    # per unit (below the allocator's granularity); at most 1 % wherever FSDP2's is.
    for world in WORLD_SIZES:
        payload = ours = theirs = allowance = 0
        for unit in CATALOG[model].units:
            shapes = [shape for _, shape in unit.params]
            buffers = plan(shapes, 1, world)
            padding = sum(b.layout.padding for b in buffers)
            gap = PLANNER_GAPS.get((model, unit.name, world), 0)
            assert gap == 0 or padding == gap, (model, unit.name, world, padding)
            payload += unit.count * sum(math.prod(s) for s in shapes)
            ours += unit.count * (padding - gap)
            theirs += unit.count * sum(fsdp2_padding(s, world) for s in shapes)
            allowance += unit.count * ((ALIGNMENT - 1) * (len(shapes) + len(buffers) * world) + SLACK * world)
        assert ours <= theirs + allowance, (model, world, ours / payload, theirs / payload)
        if theirs <= 0.01 * payload:
            assert ours <= 0.01 * payload, (model, world, ours / payload)


def test_the_cap_is_what_splits_a_dense_block_at_1024_ranks():
    # Llama-3-8B's block at W=1024: one buffer pads 6.8 % (a shard both row lengths tile);
    # FSDP2 pads nothing; the cap splits it in three, time alone (the default) keeps one buffer.
    shapes = [shape for _, shape in next(u for u in CATALOG["Llama-3-8B"].units if u.name == "decoder_layer").params]
    assert sum(fsdp2_padding(s, 1024) for s in shapes) == 0
    time_only = plan(shapes, 1, 1024, BufferSplitCost())
    assert len(time_only) == 1 and time_only[0].layout.padding_ratio > 0.06
    capped = plan(shapes, 1, 1024)
    assert len(capped) == 3 and sum(b.layout.padding for b in capped) <= 7 * (len(shapes) + 3 * 1024)


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

"""Splitting a unit into several buffers: within-class splits, the bound on any split, and
the collective cost model that picks the buffer count."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.planner_checks import assert_unit_plan_valid
from vescale_plugins.planner import padding_lower_bound, unit_plan_options
from vescale_plugins.planner.exact import exact_min_shard_size
from vescale_plugins.planner.split_bounds import (
    EXACT_TRANSITIONS,
    split_padding_lower_bound,
    unit_kinds,
)
from vescale_plugins.planner.split_spill import SMALL_COUNT, spill_partitions
from vescale_plugins.tools.model_catalog import CATALOG, block_size

SMALL = settings(
    derandomize=True, database=None, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)


def catalogue_unit(model: str, rows: int, name: str = "decoder_layer"):
    unit = next(u for u in CATALOG[model].units if u.name == name)
    shapes = [shape for _, shape in unit.params]
    return [math.prod(s) for s in shapes], [block_size(s, rows) for s in shapes]


def within(numels, blocks, world, budget, **kwargs):
    """The least-padding plan with at most ``budget`` buffers."""
    options = unit_plan_options(numels, blocks, world, **kwargs)
    return options[min(budget, len(options)) - 1]


def test_splitting_a_class_packs_a_tensor_with_fewer_blocks_than_ranks():
    # Llama-3-8B, W=256, 16-row blocks: k and v have 64 blocks each, down's block is 3.5 of
    # the others'. Whole classes pad 3.8 % at best; down with gate alone (two down blocks or
    # seven gate blocks per rank) and the rest of the class apart pack almost exactly.
    numels, blocks = catalogue_unit("Llama-3-8B", 16)
    options = unit_plan_options(numels, blocks, 256)
    assert options[0].padding_ratio > 0.06
    assert options[3].padding_ratio < 0.001, [o.padding_ratio for o in options]
    for plan in options:
        assert_unit_plan_valid(plan, numels, blocks)


def test_moe_split_reaches_the_bound_on_any_split():
    # Mixtral at W=8192, 1-row blocks: the best split of whole classes pads 1.73 %; moving
    # single experts between buffers reaches 0.58 %, which the bound proves optimal.
    numels, blocks = catalogue_unit("Mixtral-8x7B", 1)
    best = within(numels, blocks, 8192, 4)
    assert_unit_plan_valid(best, numels, blocks)
    assert best.padding == split_padding_lower_bound(numels, blocks, 8192, max_buffers=4)
    assert 0.005 < best.padding_ratio < 0.006


@pytest.mark.parametrize(
    ("model", "rows", "world", "at_least"),
    [
        ("Llama-3-70B", 1, 8192, 0.0195),  # half-row down blocks: no split fills every rank
        ("Llama-3-70B", 16, 1024, 0.097),  # down has 512 blocks for 1024 ranks
        ("GPT-OSS-120B", 16, 1024, 0.0194),
    ],
)
def test_bound_proves_cells_out_of_reach_and_the_planner_meets_it(model, rows, world, at_least):
    numels, blocks = catalogue_unit(model, rows)
    bound = split_padding_lower_bound(numels, blocks, world, max_buffers=4)
    planned = within(numels, blocks, world, 4).padding
    assert at_least * sum(numels) <= bound <= planned
    assert planned - bound <= 1e-4 * sum(numels)


def test_bound_falls_back_to_capacity_for_many_experts():
    # 300 identical experts are too many kinds-by-count for the exact search; the capacity
    # bound still proves that a 4096-element block over 8192 ranks cannot be filled.
    numels, blocks = [64 * 4096] + [3 * 512] * 300, [4096] + [512] * 300
    bound = split_padding_lower_bound(numels, blocks, 8192, max_buffers=2)
    assert bound == 8192 * 4096 - sum(numels)
    assert bound <= within(numels, blocks, 8192, 2).padding


@pytest.mark.parametrize(("rows", "world", "before"), [(1, 8192, 0.0231), (16, 1024, 0.0769)])
def test_spilling_experts_takes_qwen3_below_one_percent(rows, world, before):
    # 128 experts: too many for the exact search over count vectors. Whole classes (and the
    # fine atoms) left the decoder layer at 2.3 % and 7.7 %: o_proj's blocks (4096 elements
    # at 1-row) force their grid on whatever shares its buffer. Spilling experts: at 16-row,
    # o_proj with 80 gate/up experts fills its shards exactly, 9 down experts go to the
    # attention's buffer and the other down experts apart: 0.29 % (the same at 1-row).
    numels, blocks = catalogue_unit("Qwen3-30B-A3B", rows)
    assert unit_plan_options(numels, blocks, world)[0].padding_ratio > before
    best = within(numels, blocks, world, 4)
    assert_unit_plan_valid(best, numels, blocks)
    assert len(best.buffers) <= 4
    assert best.padding_ratio < 0.003
    # The target, over the whole model (embeddings and head included).
    payload = padding = 0
    for unit in CATALOG["Qwen3-30B-A3B"].units:
        shapes = [shape for _, shape in unit.params]
        unit_numels = [math.prod(s) for s in shapes]
        plan = within(unit_numels, [block_size(s, rows) for s in shapes], world, 4)
        payload += unit.count * sum(unit_numels)
        padding += unit.count * plan.padding
    assert padding < 0.005 * payload


@SMALL
@given(
    st.lists(
        st.tuples(st.sampled_from([1, 2, 3, 4, 6, 8, 12]), st.integers(1, 6), st.integers(1, 40)),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([4, 16, 64, 96]),
    st.sampled_from([1, 2]),
)
def test_spill_partitions_cover_the_unit_and_score_their_parts(kinds, world, alignment):
    # Kinds of (block, blocks per tensor, count): counts past SMALL_COUNT get spilled.
    numels = [block * length for block, length, count in kinds for _ in range(count)]
    blocks = [block for block, _, count in kinds for _ in range(count)]
    tiny, results = spill_partitions(tuple(numels), tuple(blocks), world, alignment, 4)
    _, problem = unit_kinds(tuple(numels), tuple(blocks), world, alignment)
    tiny_elements = sum(numels[i] for i in tiny)
    previous = None
    for budget, (value, partition) in enumerate(results, start=1):
        assert 1 <= len(partition) <= budget
        covered = sorted(i for part in partition for i in part)
        assert covered == sorted(set(range(len(numels))) - set(tiny))
        # The value is the summed bounds of these parts: never below the bound on any split
        # (exact here, the instances being small), never above a plan of them.
        parts_bound = sum(
            padding_lower_bound([numels[i] for i in part], [blocks[i] for i in part], world, alignment=alignment)
            for part in partition
        )
        assert value == max(0, parts_bound - tiny_elements)
        if problem.transitions <= EXACT_TRANSITIONS:
            assert value >= split_padding_lower_bound(numels, blocks, world, alignment=alignment, max_buffers=budget)
        assert previous is None or value <= previous
        previous = value


def test_many_experts_plan_valid_splits():
    # Two expert kinds of 150 past the exact search: unit_plan_options takes the spill
    # search's splits, every one a valid plan, padding never rising with the budget.
    numels = [64 * 4096] + [3 * 512] * 150 + [3 * 512] * 150
    blocks = [4096] + [512] * 150 + [768] * 150
    _, problem = unit_kinds(tuple(numels), tuple(blocks), 1024, 1)
    assert problem.transitions > EXACT_TRANSITIONS
    assert max(problem.counts) > SMALL_COUNT
    options = unit_plan_options(numels, blocks, 1024)
    for plan in options:
        assert_unit_plan_valid(plan, numels, blocks)
    assert all(a.padding >= b.padding for a, b in zip(options, options[1:]))


def _exact_split_padding(numels, blocks, world, alignment, budget):
    """Least padding over every partition into at most ``budget`` parts (brute force)."""
    best = None

    def parts_of(items, most):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for partition in parts_of(rest, most):
            for k in range(len(partition)):
                yield partition[:k] + [[first] + partition[k]] + partition[k + 1 :]
            if len(partition) < most:
                yield [[first]] + partition

    for partition in parts_of(list(range(len(numels))), budget):
        total = 0
        for part in partition:
            n, b = [numels[i] for i in part], [blocks[i] for i in part]
            total += world * exact_min_shard_size(n, b, world, alignment=alignment) - sum(n)
        best = total if best is None else min(best, total)
    return best


@SMALL
@given(
    st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6, 7]), st.integers(1, 9)), min_size=1, max_size=4),
    st.sampled_from([2, 3, 5, 8]),
    st.sampled_from([1, 2]),
    st.integers(1, 3),
)
def test_bound_never_exceeds_the_exact_optimum(tensors, world, alignment, budget):
    blocks = [block for block, _ in tensors]
    numels = [block * count for block, count in tensors]
    bound = split_padding_lower_bound(numels, blocks, world, alignment=alignment, max_buffers=budget)
    optimum = _exact_split_padding(numels, blocks, world, alignment, budget)
    assert 0 <= bound <= optimum
    assert within(numels, blocks, world, budget, alignment=alignment).padding >= optimum
    if budget == 1:  # no tensor here is tiny (below 1e-4 of the payload): the plain bound
        assert bound == padding_lower_bound(numels, blocks, world, alignment=alignment)


def test_bound_rejects_a_bad_budget():
    with pytest.raises(ValueError, match="max_buffers"):
        split_padding_lower_bound([4], [1], 2, max_buffers=0)


# ----------------------------------------------------------------------------------
# the collective model that prices extra buffers
# ----------------------------------------------------------------------------------


def test_split_cost_is_the_forecast_collective_model():
    # One model: the forecast's collective time is the planner's CollectiveCost with the
    # forecast hardware's figures, for groups inside a node, across nodes and at one rank
    # per node (PAT); the planner's default bandwidths and node size are the H100's.
    import dataclasses

    from vescale_plugins.forecast.comm_model import collective_cost, collective_s
    from vescale_plugins.forecast.hardware import GPUS
    from vescale_plugins.planner import CollectiveCost, plan_layout

    h100 = GPUS["h100"]
    default = CollectiveCost()
    assert (default.gpus_per_node, default.intra_bandwidth, default.inter_bandwidth) == (
        h100.gpus_per_node,
        h100.intra_node_bandwidth,
        h100.inter_node_bandwidth,
    )
    for hardware in (h100, dataclasses.replace(h100, gpus_per_node=1)):
        model = collective_cost(hardware)
        assert isinstance(model, CollectiveCost)
        for world in (2, 8, 24, 1024, 16384):
            layout = plan_layout([4096 * 3, 100], [4096, 1], world)
            expected = collective_s(layout.buffer_size * 2, world, hardware)
            assert model.unit_seconds([layout], 2) == pytest.approx(expected, rel=1e-12)
            # By hand: ring steps inside nodes and across them; PAT where one rank per node.
            per_node = min(world, hardware.gpus_per_node)
            nodes = -(-world // per_node)
            bandwidth = hardware.inter_node_bandwidth if nodes > 1 else hardware.intra_node_bandwidth
            ring = (
                (world - nodes) * hardware.intra_node_latency_s
                + (nodes - 1) * hardware.inter_node_latency_s
                + layout.buffer_size * 2 * (world - 1) / world / bandwidth
            )
            candidates = [ring]
            if per_node == 1:
                pat = 8e-6 + math.floor(math.log2(nodes)) * hardware.inter_node_latency_s / 3.5 + 2.8e-6 * world
                candidates.append(pat + layout.buffer_size * 2 / (0.75 * bandwidth))
            assert expected == pytest.approx(min(candidates), rel=1e-12)


def test_latency_grows_with_nodes_not_with_ranks_per_step():
    # NCCL's ring: only the N - 1 steps between nodes pay the network latency; with one
    # rank per node PAT's log2(N) network steps beat the ring at scale.
    from vescale_plugins.planner import CollectiveCost

    cost = CollectiveCost()
    ring_1024 = cost.seconds(0, 1024)
    assert ring_1024 == pytest.approx(8.4e-6 + (1024 - 128) * 3.4e-6 + 127 * 14e-6)
    one_per_node = CollectiveCost(gpus_per_node=1)
    assert one_per_node.seconds(0, 1024) == pytest.approx(8e-6 + 10 * 14e-6 / 3.5 + 2.8e-6 * 1024)
    assert one_per_node.seconds(0, 1024) < 1023 * 14e-6 + 8.4e-6


def test_split_pays_exactly_past_the_break_even_latency():
    from vescale_plugins.planner import CollectiveCost, choose_split

    numels, blocks = catalogue_unit("Llama-3-8B", 16)
    options = unit_plan_options(numels, blocks, 256)
    one, best = options[0], options[-1]
    saved = sum(b.shard_size for b in one.buffers) - sum(b.shard_size for b in best.buffers)
    assert saved > 0
    assert len(best.buffers) > 1

    def latency(seconds):  # a fixed latency per collective, 100 GB/s
        return CollectiveCost(base_latency_s=seconds, intra_step_s=0.0, inter_step_s=0.0, inter_bandwidth=100e9)

    counts = []
    for alpha in (0.0, 1e-9, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1.0):
        cost = latency(alpha)
        plan = choose_split(numels, blocks, 256, cost=cost)
        assert cost.unit_seconds(plan.buffers, 2) == min(cost.unit_seconds(o.buffers, 2) for o in options[:4])
        counts.append(len(plan.buffers))
    assert counts == sorted(counts, reverse=True)  # more latency, never more buffers
    assert counts[0] == len(best.buffers)
    assert counts[-1] == 1
    # Between one buffer and the best split alone: the split wins below the bytes it saves.
    extra = len(best.buffers) - 1
    threshold = saved * 2 * 255 / 100e9 / extra
    two_way = [one, best]
    for alpha, expected in ((threshold * 0.99, best), (threshold * 1.01, one)):
        cost = latency(alpha)
        assert min(two_way, key=lambda p: (cost.unit_seconds(p.buffers, 2), len(p.buffers))) is expected


def test_padding_cap_buys_memory_the_latency_does_not_pay_for():
    # Llama-3-8B's block at W=1024: one buffer pads 7 % (a shard size both row lengths
    # tile), three pad none; under NCCL's model two more collectives cost more than the
    # padding's bytes, so only a cap on the padding (FSDP2's: 0) splits.
    from vescale_plugins.planner import choose_split, plan_layout

    numels, blocks = catalogue_unit("Llama-3-8B", 1, "decoder_layer")
    single = plan_layout(numels, blocks, 1024, alignment=8)
    assert single.padding_ratio > 0.06
    assert len(choose_split(numels, blocks, 1024, alignment=8).buffers) == 1
    capped = choose_split(numels, blocks, 1024, alignment=8, padding_cap=0)
    assert capped.padding <= 7 * (len(numels) + len(capped.buffers) * 1024)
    assert len(capped.buffers) == 3


def test_small_worlds_keep_one_buffer():
    # A small MLP unit at W=2 (the default bench's scale): padding is at most a few
    # elements per rank, far below the bytes one extra collective's latency could move.
    from vescale_plugins.planner import choose_split

    numels, blocks = [256 * 64, 256, 64 * 256, 64, 10 * 64, 10], [64, 1, 256, 1, 64, 1]
    for world in (1, 2, 3):
        assert len(choose_split(numels, blocks, world).buffers) == 1


def test_choose_split_rejects_nonsense():
    from vescale_plugins.planner import CollectiveCost, choose_split

    with pytest.raises(ValueError, match="intra_step_s"):
        CollectiveCost(intra_step_s=-1.0)
    with pytest.raises(ValueError, match="inter_bandwidth"):
        CollectiveCost(inter_bandwidth=0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        CollectiveCost(gpus_per_node=0)
    with pytest.raises(ValueError, match="max_buffers"):
        choose_split([4], [1], 2, max_buffers=0)
    with pytest.raises(ValueError, match="padding_cap"):
        choose_split([4], [1], 2, padding_cap=-1)


def test_padding_table_rows_and_markdown(tmp_path):
    from vescale_plugins.planner import plan_layout
    from vescale_plugins.tools import padding_table

    rows = padding_table.padding_rows(["Llama-3-8B"], [16], [256])
    (row,) = rows
    numels, blocks = catalogue_unit("Llama-3-8B", 16)
    decoder_count = next(u.count for u in CATALOG["Llama-3-8B"].units if u.name == "decoder_layer")
    # The decoder layers dominate: 32 of them, each 6.97 % in one buffer.
    assert row["before_padding_elements"] >= decoder_count * plan_layout(numels, blocks, 256).padding
    assert row["least_padding_elements_max4"] <= row["after_padding_elements"] <= row["before_padding_elements"]
    assert row["before_mib_per_rank"] == pytest.approx(row["before_padding_elements"] * 2 / 256 / 2**20)
    table = padding_table.markdown(rows)
    assert "| Llama-3-8B | 16 | 256 | 4.17 (6.97) |" in table


def test_padding_table_puts_megatron_fsdp_layout_beside_ours_and_fsdp2s():
    from vescale_plugins.tools import padding_table

    (row,) = padding_table.fsdp2_rows(["Llama-3-8B"], [1024], [1])
    # Megatron-FSDP pads every shard to the least common multiple of the rows (6.76 % of the
    # model here), where ours and FSDP2 pad 0.08 %.
    assert row["megatron_fsdp_padding_elements"] > 50 * row["padding_elements"]
    assert row["padding_elements"] <= row["fsdp2_padding_elements"]
    assert "Megatron-FSDP % no blocks" in padding_table.fsdp2_markdown([row])

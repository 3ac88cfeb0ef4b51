"""The one place DBuffers get their layouts: what the planner is asked for a group of
parameters, and how many buffers the group is split into.

Each DBuffer costs its own all-gather and reduce-scatter. A group is split where NCCL's
collective model says the padding saved outweighs the extra collectives' latency
(:func:`vescale_plugins.planner.choose_split`); with ``cap_at_fsdp2_padding``, where the user
asked for no block structure (every block one row), also wherever that is what keeps its
padding at most FSDP2's for the same parameters.

Parameters nothing asks rows of (``block_rows`` ``None``: no ``block_size_fn`` answer, not
tensor-parallel, ...) are planned in rows of dim 0, as FSDP2's ``Shard(0)``, wherever that
pads at most what FSDP2 pads for the same parameters plus the cap's slack, in one buffer,
and wastes no memory worth having back (``ROWS_WASTE_*``); elsewhere (one buffer holding
rows of several lengths at many ranks, tensors with fewer rows than ranks) they are planned
element-wise (blocks of one element: the paper's RaggedShard over all dims, a 1-D local
shard), which pads at most the 16-byte alignment, where that pads less, or as little in
fewer buffers (collectives). The choice depends on the shapes, dtypes and world size only,
so every rank makes the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vescale_plugins.planner import CollectiveCost, Layout, choose_split
from vescale_plugins.planner.baselines import fsdp2_padding

__all__ = [
    "ALIGNMENT_BYTES",
    "BufferPlan",
    "BufferSplitCost",
    "is_elementwise",
    "plan_buffers",
    "planner_inputs",
    "quantization_block",
    "row_numel",
]

# Collectives and vectorised kernels like 16-byte aligned buffers; offsets are in elements.
ALIGNMENT_BYTES = 16
# The padding cap applies where FSDP2 pads at most this share of the group's parameters.
FSDP2_CAP_UP_TO = 0.01
# ... and lets each rank pad this much more than FSDP2: the CUDA caching allocator rounds
# every block to 512 bytes (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize), so less is
# below the granularity memory is handed out in, and not worth a collective.
CAP_SLACK_BYTES_PER_RANK = 512
# Rows are also given up (for an element-wise cut) where they pad more than this share of the
# group's parameters and more than this many bytes over all ranks: memory worth having back,
# never the few rows a small model pads at a few ranks (those keep FSDP2's 2-D local shapes).
ROWS_WASTE_SHARE = 0.01
ROWS_WASTE_BYTES = 1 << 20
# A row longer than a quantization block is cut into equal runs (a divisor of the row) if
# one of at least this share of the block exists; else the whole row is one block (rows of
# a prime length), which keeps the scales few rather than the blocks short.
QUANT_DIVISOR_SHARE = 4


@dataclass(frozen=True)
class BufferSplitCost:
    """What a split costs, and the most buffers one (mesh, dtype, requires_grad) group may
    get. ``fully_shard`` takes one (``buffer_split_cost=``); the same on every rank.

    By default NCCL's tuner model with its own constants (:class:`CollectiveCost`) on nodes
    of ``gpus_per_node`` GPUs. ``alpha_s`` (seconds per ring step, every step) and
    ``beta_bytes_per_s`` (bus bandwidth) replace its latencies and bandwidths.
    ``cap_at_fsdp2_padding``: where no block structure is asked for, split further if that
    is what keeps the padding at most FSDP2's (memory first). Off by default: at scale the
    extra collectives cost more time than the padding costs memory (docs/fully_shard.md has
    the figures).
    """

    alpha_s: float | None = None
    beta_bytes_per_s: float | None = None
    max_buffers: int = 4
    gpus_per_node: int = CollectiveCost.gpus_per_node
    cap_at_fsdp2_padding: bool = False

    def __post_init__(self) -> None:
        self.collective_cost()  # validates alpha, beta and gpus_per_node
        if not isinstance(self.max_buffers, int) or self.max_buffers < 1:
            raise ValueError(f"max_buffers must be an int >= 1, got {self.max_buffers!r}")

    def collective_cost(self) -> CollectiveCost:
        latency: dict[str, float] = {}
        if self.alpha_s is not None:
            if not self.alpha_s >= 0:
                raise ValueError(f"alpha_s (seconds per ring step) must be >= 0, got {self.alpha_s}")
            latency = {"base_latency_s": 0.0, "intra_step_s": self.alpha_s, "inter_step_s": self.alpha_s}
        bandwidth: dict[str, float] = {}
        if self.beta_bytes_per_s is not None:
            if not self.beta_bytes_per_s > 0:
                raise ValueError(f"beta_bytes_per_s must be > 0, got {self.beta_bytes_per_s}")
            bandwidth = {"intra_bandwidth": self.beta_bytes_per_s, "inter_bandwidth": self.beta_bytes_per_s}
        return CollectiveCost(gpus_per_node=self.gpus_per_node, **latency, **bandwidth)


@dataclass(frozen=True)
class BufferPlan:
    """One DBuffer of a group: the positions of its parameters in the group (ascending) and
    its layout."""

    positions: tuple[int, ...]
    layout: Layout


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one dim-0 row (a 0-d or 1-d parameter's row is one element)."""
    return math.prod(shape[1:]) if len(shape) > 0 else 1


def is_elementwise(shape: torch.Size, block: int) -> bool:
    """Whether a parameter planned with blocks of ``block`` elements is cut element-wise (its
    local shard a 1-D run of elements, ``RaggedShard(dims=all)``) rather than in rows of dim 0:
    its block is shorter than a row."""
    return len(shape) >= 2 and math.prod(shape) > 0 and block < row_numel(shape)


def quantization_block(shape: Sequence[int], block: int) -> int:
    """Elements per quantization block of a parameter of ``shape`` whose collectives are
    quantized in blocks of about ``block`` elements: blocks are runs of this many elements
    counted from the parameter's first (the last may be shorter). A function of the shape
    alone, so the blocks are the same at every world size: a row longer than ``block`` is cut
    into equal runs (the largest divisor of the row up to ``block``), shorter rows are grouped
    whole (``block // row`` of them); with the planner asked for multiples of it
    (:func:`planner_inputs`) no block straddles two ranks."""
    if math.prod(shape) == 0:
        return 1
    row = row_numel(shape)
    if row <= block:
        return row * (block // row)
    divisor = next(d for d in range(block, 0, -1) if row % d == 0)
    return divisor if divisor * QUANT_DIVISOR_SHARE >= block else row


def planner_inputs(
    shapes: Sequence[torch.Size],
    block_rows: Sequence[int | None],
    dtype: torch.dtype,
    elementwise: Sequence[bool] | None = None,
    quant_block: int | None = None,
) -> tuple[list[int], list[int], int]:
    """What the planner is asked for these parameters: numels, block sizes and alignment, in
    elements (``ALIGNMENT_BYTES`` of ``dtype``). A zero-size parameter (FSDP2 accepts them)
    is planned as one element that holds nothing. ``block_rows`` ``None`` is one row, or one
    element where ``elementwise`` says so. With ``quant_block`` (quantized collectives) each
    block is also a multiple of the parameter's :func:`quantization_block`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numels = [max(1, math.prod(s)) for s in shapes]
    cut = elementwise or [False] * len(shapes)
    blocks = [
        1 if flat or not (len(s) and math.prod(s)) else (rows or 1) * row_numel(s)
        for s, rows, flat in zip(shapes, block_rows, cut)
    ]
    if quant_block is not None:
        blocks = [math.lcm(b, quantization_block(s, quant_block)) for b, s in zip(blocks, shapes)]
    return numels, blocks, max(1, ALIGNMENT_BYTES // itemsize)


def plan_buffers(
    shapes: Sequence[torch.Size],
    block_rows: Sequence[int | None],
    dtype: torch.dtype,
    comm_dtype: torch.dtype,
    world_size: int,
    cost: BufferSplitCost = BufferSplitCost(),
    quant_block: int | None = None,
) -> list[BufferPlan]:
    """The group's buffers, ordered by their first parameter. ``comm_dtype`` is what the
    collectives move (the cost model counts its bytes). ``block_rows[i]`` ``None``: nothing
    asks rows of parameter ``i``; it is planned in rows where that pads at most FSDP2's (plus
    the cap's slack) and little, else element-wise (module docstring). ``quant_block``: the
    collectives are quantized in blocks of about that many elements; every block the planner
    keeps whole is then a multiple of :func:`quantization_block` (``None``: today's plan)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Each rank's chunk of the gather starts at a multiple of the shard size: aligned in the
    # gathered dtype too (an fp32 shard gathered in bf16 needs twice the elements).
    alignment = max(ALIGNMENT_BYTES // itemsize, ALIGNMENT_BYTES // torch.empty((), dtype=comm_dtype).element_size(), 1)
    rows = [1 if r is None else r for r in block_rows]
    # FSDP2's padding for these parameters in rows (its Shard(0)), and what the cap allows
    # above it: 512 bytes per rank, below the allocator's granularity.
    fsdp2 = _fsdp2_padding(shapes, rows, world_size)
    slack = world_size * (CAP_SLACK_BYTES_PER_RANK // itemsize)
    plans = _plan(shapes, rows, None, dtype, comm_dtype, world_size, cost, alignment, fsdp2, slack, quant_block)
    cuttable = [r is None and is_elementwise(torch.Size(s), 1) for s, r in zip(shapes, block_rows)]
    if any(cuttable):

        def within(buffers: list[BufferPlan]) -> bool:
            # The cap's criterion: FSDP2's padding, its slack, and the 16-byte alignment
            # (a - 1 elements before each tensor and per rank at each buffer's end).
            allowance = (alignment - 1) * (len(shapes) + len(buffers) * world_size)
            return sum(p.layout.padding for p in buffers) <= fsdp2 + slack + allowance

        rows_within = within(plans)
        rows_padding = sum(p.layout.padding for p in plans)
        # Rows that beat FSDP2 may still waste real memory (tensors with fewer rows than
        # ranks, such as fused experts at 1,024 ranks, where FSDP2 wastes more): then too.
        wasteful = (
            rows_padding > ROWS_WASTE_SHARE * sum(math.prod(s) for s in shapes)
            and rows_padding * itemsize > ROWS_WASTE_BYTES
        )
        if not rows_within or wasteful or len(plans) > 1:
            flat = _plan(
                shapes, rows, cuttable, dtype, comm_dtype, world_size, cost, alignment, fsdp2, slack, quant_block
            )
            if rows_within and not wasteful:  # rows pad little but take more collectives
                better = within(flat) and len(flat) < len(plans)
            else:
                better = sum(p.layout.padding for p in flat) < rows_padding and len(flat) <= len(plans)
            if better:
                plans = flat
    return plans


def _fsdp2_padding(shapes: Sequence[torch.Size], rows: Sequence[int], world_size: int) -> int:
    """FSDP2 pads dim 0 of each parameter to a multiple of the world size: torch.chunk gives
    every rank ceil(dim0 / W) rows and the sharded parameter is padded to chunk 0's size
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, FSDPParam._init_sharded_param:
    ``padded_sharded_size = chunks[0].size()  # 0th always padded``);
    with blocks of ``rows`` rows, to whole blocks per rank."""
    kept = [(tuple(s) if len(s) else (1,), r) for s, r in zip(shapes, rows) if math.prod(s)]
    return fsdp2_padding([s for s, _ in kept], [r * row_numel(torch.Size(s)) for s, r in kept], world_size)


def _plan(
    shapes: Sequence[torch.Size],
    rows: Sequence[int],
    elementwise: Sequence[bool] | None,
    dtype: torch.dtype,
    comm_dtype: torch.dtype,
    world_size: int,
    cost: BufferSplitCost,
    alignment: int,
    fsdp2: int,
    slack: int,
    quant_block: int | None = None,
) -> list[BufferPlan]:
    numels, blocks, _ = planner_inputs(shapes, rows, dtype, elementwise, quant_block)
    cap = None
    if cost.cap_at_fsdp2_padding and all(r == 1 for r in rows):
        # Where FSDP2 itself pads more (tensors with fewer rows than ranks), its padding is
        # no bar worth extra collectives: time alone decides.
        cap = fsdp2 + slack if fsdp2 <= FSDP2_CAP_UP_TO * sum(numels) else None
    plan = choose_split(
        numels,
        blocks,
        world_size,
        cost=cost.collective_cost(),
        bytes_per_element=torch.empty((), dtype=comm_dtype).element_size(),
        alignment=alignment,
        max_buffers=cost.max_buffers,
        padding_cap=cap,
    )
    return [BufferPlan(tuple(members), layout) for members, layout in zip(plan.members, plan.buffers)]

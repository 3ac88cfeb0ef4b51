"""Pure arithmetic of a RaggedShard layout: who owns which elements, and in what local shape.

No process group, no DTensor: the placement, the planner and DBuffer all build on these
functions, so they are cheap, deterministic, and validate their input with messages that
say what would fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from vescale_plugins.ragged.units import UnitRuns

__all__ = ["RankSlice", "RankSlices", "RaggedLayout", "ragged_layout", "validate_ragged", "flat_interval_boxes"]


@dataclass(frozen=True)
class RankSlice:
    """One rank's part of a ragged-sharded tensor.

    ``offset`` and ``length`` are in elements of the row-major flat storage of the global
    tensor; ``local_shape`` is the shape of that rank's local tensor.
    """

    offset: int
    length: int
    local_shape: tuple[int, ...]


@dataclass(frozen=True)
class RaggedLayout:
    """Every rank's slice of one tensor under ``RaggedShard(dims, local_units)``.

    ``local_units`` counts each rank's blocks (the tensor is cut into ``sum(local_units)``
    equal blocks); ``row_numel`` is the elements in one row (the product of the trailing,
    never-split dims); ``block_rows`` is the rows in one block. ``slices[r]`` is computed when
    asked for (from the counts' runs), so a layout costs the same at any world size.
    """

    shape: tuple[int, ...]
    dims: tuple[int, ...]
    local_units: UnitRuns
    row_numel: int
    block_rows: int
    slices: RankSlices


class RankSlices(Sequence[RankSlice]):
    """The ranks' :class:`RankSlice` of one layout, each computed on access."""

    def __init__(self, shape: tuple[int, ...], dims: tuple[int, ...], blocks: UnitRuns, block_numel: int) -> None:
        self._shape, self._dims, self._blocks, self._block_numel = shape, dims, blocks, block_numel
        row_numel = math.prod(shape[len(dims) :])
        self._block_rows = block_numel // row_numel if row_numel else 0

    def __len__(self) -> int:
        return len(self._blocks)

    @overload
    def __getitem__(self, rank: int) -> RankSlice: ...

    @overload
    def __getitem__(self, rank: slice) -> tuple[RankSlice, ...]: ...

    def __getitem__(self, rank: int | slice) -> RankSlice | tuple[RankSlice, ...]:
        if isinstance(rank, slice):
            return tuple(self._slice(r) for r in range(len(self))[rank])
        if not -len(self) <= rank < len(self):
            raise IndexError(f"rank {rank} of {len(self)}")
        return self._slice(rank % len(self))

    def _slice(self, rank: int) -> RankSlice:
        return self._make(self._blocks.prefix(rank), self._blocks[rank])

    def __iter__(self) -> Iterator[RankSlice]:
        start = 0
        for blocks in self._blocks:
            yield self._make(start, blocks)
            start += blocks

    def _make(self, start_block: int, blocks: int) -> RankSlice:
        shape = self._shape
        if not self._dims:
            local_shape = shape if blocks else (0, *shape[1:]) if shape else (0,)
        else:
            local_shape = (blocks * self._block_rows, *shape[len(self._dims) :])
        return RankSlice(start_block * self._block_numel, blocks * self._block_numel, local_shape)

    def _key(self) -> tuple:
        return (self._shape, self._dims, self._blocks, self._block_numel)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankSlices):
            return self._key() == other._key()
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(self._key())


def _divisor_hint(numel: int, row_numel: int) -> str:
    """Block totals that would fit: those giving whole rows per block."""
    rows = numel // row_numel if row_numel else 0
    if rows == 0:
        return "the tensor is empty, so any local_units of at least one rank fit"
    divisors = [d for d in range(1, min(rows, 64) + 1) if rows % d == 0]
    return f"sum(local_units) must divide the {rows} rows, e.g. one of {divisors}"


def validate_ragged(shape: Sequence[int], dims: Sequence[int], local_units: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``RaggedShard(dims, local_units)`` can describe ``shape``.

    Rules: ``dims`` is the prefix ``(0, ..., k-1)`` of the tensor's dims; the block counts
    are non-negative with a positive sum; one block (``numel // sum(local_units)`` elements)
    is a whole number of rows of ``dims`` (a row = the trailing dims ``shape[k:]``).
    """
    shape, dims, blocks = tuple(shape), tuple(dims), UnitRuns.of(local_units)

    def where() -> str:
        return f"RaggedShard(dims={dims}, local_units={blocks}) on shape {shape}"

    _validate_placement_args(dims, blocks, where)
    if len(dims) > len(shape):
        raise ValueError(
            f"{where()}: dims names {len(dims)} dims but the tensor has only {len(shape)}; "
            f"use a prefix of (0, ..., {len(shape) - 1})"
        )
    row_numel = math.prod(shape[len(dims) :])
    numel = math.prod(shape)
    total_blocks = blocks.total
    if numel % total_blocks or (numel // total_blocks) % max(row_numel, 1):
        raise ValueError(
            f"{where()}: {numel} elements do not split into {total_blocks} equal blocks of whole "
            f"rows of {row_numel} elements; {_divisor_hint(numel, row_numel)}"
        )


def _validate_placement_args(dims: tuple[int, ...], blocks: UnitRuns, where: Callable[[], str]) -> None:
    """The checks that need no tensor shape: dims form a prefix, block counts are sane.
    ``where`` names the placement in an error (built only then: its counts may be long)."""
    if dims != tuple(range(len(dims))):
        raise ValueError(
            f"{where()}: dims must be a prefix (0, 1, ..., k-1) of the tensor's dims, e.g. {tuple(range(len(dims)))}"
        )
    if not len(blocks):
        raise ValueError(f"{where()}: local_units is empty; give one entry per rank of the mesh dim")
    if any((not isinstance(b, int)) or b < 0 for b, _ in blocks.runs):
        raise ValueError(f"{where()}: local_units must be non-negative integers")
    if blocks.total == 0:
        raise ValueError(f"{where()}: local_units are all zero; at least one rank must hold a block")


def ragged_layout(shape: Sequence[int], dims: Sequence[int], local_units: Sequence[int]) -> RaggedLayout:
    """Every rank's ``(offset, length)`` in elements and its local shape.

    Rank ``r`` holds blocks ``[sum(u[:r]), sum(u[:r+1]))`` of the flat row-major storage
    (``u = local_units``; ``sum(u)`` equal blocks).
    Its local tensor has shape ``(rows_r, *shape[k:])`` with ``k = len(dims)``, so a row-wise
    shard of a 2-D weight is 2-D with uneven rows and an element-wise shard is 1-D.
    ``dims=()`` puts the whole tensor (one block) on one rank, which keeps the full shape.
    """
    shape, dims, blocks = tuple(shape), tuple(dims), UnitRuns.of(local_units)
    validate_ragged(shape, dims, blocks)
    row_numel = math.prod(shape[len(dims) :])
    block_numel = math.prod(shape) // blocks.total
    block_rows = block_numel // row_numel if row_numel else 0
    return RaggedLayout(shape, dims, blocks, row_numel, block_rows, RankSlices(shape, dims, blocks, block_numel))


def flat_interval_boxes(shape: Sequence[int], start: int, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cover the flat interval ``[start, start + length)`` of a row-major tensor with boxes.

    Returns ``(offsets, sizes)`` pairs, in storage order, each a regular N-D box whose
    elements are contiguous in storage (leading partial rows, a middle block, trailing
    partial rows, recursively), so each is a view of the flat interval. Used to describe a
    ragged shard to torch.distributed.checkpoint without communication.
    """
    shape = tuple(shape)
    if length == 0:
        return []
    if not shape:
        return [((), ())]
    return _boxes(shape, start, start + length)


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    inner = math.prod(shape[1:])
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    first_row, last_row = lo // inner, (hi - 1) // inner
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    row_lo = first_row
    if lo % inner:
        # Leading partial row: recurse inside it.
        end = min(hi, (first_row + 1) * inner)
        boxes += [
            ((first_row, *o), (1, *s)) for o, s in _boxes(shape[1:], lo - first_row * inner, end - first_row * inner)
        ]
        row_lo = first_row + 1
    row_hi = last_row + 1 if hi % inner == 0 else last_row
    if row_hi > row_lo:
        boxes.append(((row_lo, *(0,) * (len(shape) - 1)), (row_hi - row_lo, *shape[1:])))
    if hi % inner and last_row >= row_lo:
        boxes += [((last_row, *o), (1, *s)) for o, s in _boxes(shape[1:], 0, hi - last_row * inner)]
    return boxes

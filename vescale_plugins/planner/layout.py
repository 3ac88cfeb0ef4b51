"""The planner's answer for one buffer: where every tensor starts and what every rank owns.

A buffer of ``world_size * shard_size`` elements is cut into ``world_size`` equal shards; rank
``r`` owns ``[r * shard_size, (r + 1) * shard_size)``. Each tensor is one contiguous interval of
the buffer. Everything here is in elements (never bytes); "blocks" are a tensor's indivisible
runs of ``block_size`` elements (a block of rows, or single elements), counted from the
tensor's start; when ``block_size`` does not divide the numel the last block is shorter
(1031 rows in blocks of 32 rows: 32 blocks of 32 rows and one of 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

__all__ = ["Layout", "check_plan_inputs", "effective_block_sizes"]


def check_plan_inputs(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, alignment: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate a planning problem and return it as tuples of ints.

    Raises ``ValueError`` naming the offending tensor index and values: the rules are
    positive numels and block sizes, ``world_size >= 1``, ``alignment >= 1`` and one block
    size per numel. A block size need not divide its numel (the last block is shorter);
    the block sizes come back capped at their numels (:func:`effective_block_sizes`).
    """
    numels, block_sizes = tuple(numels), tuple(block_sizes)
    if len(numels) != len(block_sizes):
        raise ValueError(
            f"got {len(numels)} numels but {len(block_sizes)} block sizes; give exactly one block size per tensor"
        )
    if not numels:
        raise ValueError("nothing to plan: numels is empty; give at least one tensor")
    _check_positive_int("world_size", world_size)
    _check_positive_int("alignment", alignment)
    for index, (numel, block) in enumerate(zip(numels, block_sizes)):
        if not _is_int(numel) or numel < 1:
            raise ValueError(f"tensor {index}: numel must be a positive int, got {numel!r}")
        if not _is_int(block) or block < 1:
            raise ValueError(f"tensor {index}: block size must be a positive int, got {block!r}")
    numels = tuple(int(x) for x in numels)
    return numels, effective_block_sizes(numels, tuple(int(x) for x in block_sizes))


def effective_block_sizes(numels: Sequence[int], block_sizes: Sequence[int]) -> tuple[int, ...]:
    """Each block size capped at its tensor's numel: a tensor shorter than one block is one
    (short) block, so it needs no rank larger than itself."""
    return tuple(min(numel, block) for numel, block in zip(numels, block_sizes))


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True as a numel is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """One buffer's plan: tensor offsets and an equal shard size for every rank.

    Fields (all in elements):
        numels, block_sizes: the problem, in input order.
        world_size: ranks sharing the buffer; alignment: offsets and shard size are multiples.
        shard_size: S, the elements every rank owns (the collective's per-rank size).
        offsets: start of tensor ``i`` in the global buffer of ``world_size * shard_size``.
        shard_size_lower_bound: no valid single-buffer layout has a smaller shard size
            (see :func:`vescale_plugins.planner.bounds.shard_size_lower_bound`).

    Construction checks the four guarantees' structural part (aligned, contiguous,
    non-overlapping, inside the buffer, no block cut by a rank boundary) and raises
    ``ValueError`` otherwise, so a ``Layout`` that exists is always safe to shard with.
    """

    numels: tuple[int, ...]
    block_sizes: tuple[int, ...]
    world_size: int
    alignment: int
    shard_size: int
    offsets: tuple[int, ...]
    shard_size_lower_bound: int

    def __post_init__(self) -> None:
        check_plan_inputs(self.numels, self.block_sizes, self.world_size, self.alignment)
        if len(self.offsets) != len(self.numels):
            raise ValueError(f"{len(self.offsets)} offsets for {len(self.numels)} tensors")
        if self.shard_size < 1 or self.shard_size % self.alignment:
            raise ValueError(
                f"shard_size {self.shard_size} must be a positive multiple of the alignment {self.alignment}"
            )
        if not 1 <= self.shard_size_lower_bound <= self.shard_size:
            raise ValueError(
                f"shard_size_lower_bound {self.shard_size_lower_bound} must be in [1, shard_size={self.shard_size}]"
            )
        self._check_intervals()
        for index in range(len(self.numels)):
            self._check_blocks_not_cut(index)

    def _check_intervals(self) -> None:
        """Aligned, non-overlapping intervals inside the buffer."""
        end_of_previous, previous = 0, None
        for index in self.placement_order:
            start = self.offsets[index]
            if start % self.alignment:
                raise ValueError(f"tensor {index}: offset {start} is not a multiple of the alignment {self.alignment}")
            if start < end_of_previous:
                raise ValueError(
                    f"tensor {index} at {start} overlaps tensor {previous}, which ends at {end_of_previous}"
                )
            end_of_previous, previous = start + self.numels[index], index
        if end_of_previous > self.buffer_size:
            raise ValueError(
                f"tensor {previous} ends at {end_of_previous}, past the buffer of "
                f"{self.world_size} x {self.shard_size} = {self.buffer_size} elements"
            )

    def _check_blocks_not_cut(self, index: int) -> None:
        """Every rank boundary strictly inside tensor ``index`` falls between two blocks."""
        start, stop = self.tensor_slice(index)
        block, shard = self.block_sizes[index], self.shard_size
        first_boundary = (start // shard + 1) * shard
        if first_boundary >= stop:
            return
        cut_first = (first_boundary - start) % block
        cut_later = first_boundary + shard < stop and shard % block
        if cut_first or cut_later:
            raise ValueError(
                f"tensor {index} ([{start}, {stop}), block {block}) has a block cut by a rank "
                f"boundary (shard size {shard})"
            )

    @property
    def buffer_size(self) -> int:
        """Elements in the unsharded (all-gathered) buffer: ``world_size * shard_size``."""
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        """Elements of the buffer that belong to no tensor: ``buffer_size - sum(numels)``."""
        return self.buffer_size - sum(self.numels)

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the payload ``sum(numels)`` (the collective's overhead)."""
        return self.padding / sum(self.numels)

    @property
    def padding_lower_bound(self) -> int:
        """Padding elements at ``shard_size_lower_bound``: no single buffer pads less."""
        return self.world_size * self.shard_size_lower_bound - sum(self.numels)

    @property
    def padding_lower_bound_ratio(self) -> float:
        """``padding_lower_bound`` as a fraction of the payload ``sum(numels)``."""
        return self.padding_lower_bound / sum(self.numels)

    @property
    def placement_order(self) -> tuple[int, ...]:
        """Tensor indices sorted by offset (ties, impossible for valid layouts, by index)."""
        return tuple(sorted(range(len(self.offsets)), key=lambda i: (self.offsets[i], i)))

    def tensor_slice(self, index: int) -> tuple[int, int]:
        """Tensor ``index``'s global interval ``(start, stop)`` in the buffer, elements."""
        start = self.offsets[index]
        return start, start + self.numels[index]

    def ranks_of(self, index: int) -> range:
        """The ranks that hold at least one element of tensor ``index``."""
        start, stop = self.tensor_slice(index)
        return range(start // self.shard_size, (stop - 1) // self.shard_size + 1)

    def rank_range(self, index: int, rank: int) -> tuple[int, int]:
        """``(start, length)`` in elements of tensor ``index`` inside rank ``rank``'s own shard.

        ``start`` is relative to the rank's shard; ``(0, 0)`` when the rank holds none of it.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        start, stop = self.tensor_slice(index)
        shard_start = rank * self.shard_size
        low = max(start, shard_start)
        high = min(stop, shard_start + self.shard_size)
        if low >= high:
            return 0, 0
        return low - shard_start, high - low

    def shard_ranges(self, index: int) -> tuple[tuple[int, int], ...]:
        """``rank_range(index, r)`` for every rank ``r`` (a tuple of ``world_size`` pairs)."""
        ranges = [(0, 0)] * self.world_size
        for rank in self.ranks_of(index):
            ranges[rank] = self.rank_range(index, rank)
        return tuple(ranges)

    def local_units(self, index: int) -> tuple[int, ...]:
        """Blocks of tensor ``index`` held by each rank (the last block may be shorter).

        A block is ``block_sizes[index]`` elements; the tuple has
        ``world_size`` entries (zeros allowed) summing to ``ceil(numels[index] / block)``.
        When the block divides the numel this is ``RaggedShard``'s ``local_units``.
        """
        block = self.block_sizes[index]
        return tuple(-(-length // block) for _, length in self.shard_ranges(index))

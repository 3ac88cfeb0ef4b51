"""Per-rank block counts of a RaggedShard (its ``local_units``), stored as runs of equal counts.

A sharded parameter touches a few consecutive ranks of its shard group: zeros, a partial
rank, whole ranks, a partial rank, zeros. As runs that is at most five pairs whatever the
world size, so a placement, its hash and its equality cost O(runs), not O(ranks); a rank's
count and the blocks before it are found by walking the runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

__all__ = ["UnitRuns"]


class UnitRuns(Sequence[int]):
    """An immutable sequence of non-negative ints, one per rank, kept as ``(value, count)``
    runs (adjacent runs of equal value merged, empty runs dropped: one form per sequence).

    Equal to any sequence with the same ints (a tuple or list of them included). Its hash is
    that of its runs, not the equal tuple's: do not mix the two as keys of one dict.
    """

    __slots__ = ("_len", "runs")

    def __init__(self, runs: Iterable[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        for value, count in runs:
            if count < 0:
                raise ValueError(f"a run of {count} ranks")
            if count == 0:
                continue
            if merged and merged[-1][0] == value:
                merged[-1] = (value, merged[-1][1] + count)
            else:
                merged.append((value, count))
        self.runs: tuple[tuple[int, int], ...] = tuple(merged)
        self._len = sum(count for _, count in merged)

    @classmethod
    def of(cls, counts: Sequence[int]) -> UnitRuns:
        """``counts`` as runs (itself when it already is)."""
        if isinstance(counts, UnitRuns):
            return counts
        return cls((value, len(list(group))) for value, group in itertools.groupby(counts))

    @property
    def total(self) -> int:
        """The sum of all counts."""
        return sum(value * count for value, count in self.runs)

    def prefix(self, index: int) -> int:
        """The sum of the counts before position ``index`` (``0 <= index <= len``)."""
        before, seen = 0, 0
        for value, count in self.runs:
            if seen + count >= index:
                return before + value * (index - seen)
            before += value * count
            seen += count
        return before

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        position = index + self._len if index < 0 else index
        if not 0 <= position < self._len:
            raise IndexError(f"rank {index} of {self._len}")
        for value, count in self.runs:
            if position < count:
                return value
            position -= count
        raise AssertionError("unreachable: the runs cover len")

    def __iter__(self) -> Iterator[int]:
        for value, count in self.runs:
            yield from itertools.repeat(value, count)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, UnitRuns):
            return self.runs == other.runs
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == self._len and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.runs)

    def __reduce__(self) -> tuple:
        return (UnitRuns, (self.runs,))

    def __repr__(self) -> str:
        # Short ones as the tuple users write; long ones as their runs.
        return repr(tuple(self)) if self._len <= 64 else f"UnitRuns({self.runs!r})"

"""What no single-buffer layout can beat, and which shard sizes are worth trying.

Facts every valid layout obeys (sizes in elements, ``S`` the shard size, ``a`` the alignment,
``g`` a tensor's block size, ``L = lcm(a, g)``, ``e`` its numel):

* A block sits inside one rank, so ``S >= g``; tensors start on multiples of ``a`` and the
  buffer end is one, so ``W * S >= sum(round_up(e, a))``.
* A tensor spanning two rank boundaries has both on block boundaries, so ``g | S``.
* A tensor longer than ``S`` crosses at least one boundary. If ``g`` does not divide ``S`` it
  may cross only one, at a distance from its start that is a multiple of ``L`` (the boundary
  and the start are multiples of ``a``) and smaller than ``S``, hence at most
  ``S - (S mod L)``; what follows the boundary is at most ``S``, so
  ``e <= 2S - (S mod L)``. A tensor longer than ``2S`` can never meet this: ``g | S``.

Call ``S`` *admissible* when ``a | S`` and every tensor meets the last rule. The lower bound is
the smallest admissible ``S`` meeting the first two; the search only tries admissible sizes.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

from vescale_plugins.planner.layout import check_plan_inputs

__all__ = [
    "AdmissibleShardSizes",
    "aligned_payload",
    "lower_bound_from_parts",
    "padding_lower_bound",
    "shard_size_lower_bound",
]


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= value``."""
    return -(-value // multiple) * multiple


def aligned_payload(numels: Sequence[int], alignment: int) -> int:
    """Elements the tensors occupy when each starts on an ``alignment`` multiple.

    The buffer end is itself aligned, so even the last tensor's round-up is paid: every
    layout's buffer holds at least this many elements.
    """
    return sum(round_up(numel, alignment) for numel in numels)


class AdmissibleShardSizes:
    """Answers "the smallest admissible shard size >= S" for one problem.

    Two layers: a fast one for the tensors longer than ``2S``, which must have ``g | S`` (they
    change only at the thresholds ``S = ceil(e / 2)``, between which ``S`` steps over the
    multiples of one lcm, found by bisection), then an exact check of the rule for the
    tensors longer than ``S``, grouped by ``(numel, block)``.
    """

    def __init__(self, numels: Sequence[int], block_sizes: Sequence[int], alignment: int):
        self._alignment = alignment
        # Identical tensors impose identical rules: work on the distinct (numel, block) kinds.
        kinds = sorted(set(zip(numels, block_sizes)), reverse=True)
        # Kind k (largest numel first) is longer than 2S iff S <= last_forced[k]; the list is
        # decreasing, stored negated so bisect sees it ascending.
        self._negated_last_forced = [-((numel - 1) // 2) for numel, _ in kinds]
        self._lcms = [alignment]
        for _, block in kinds:
            self._lcms.append(math.lcm(self._lcms[-1], block))
        self._kinds = [(numel, block, math.lcm(alignment, block)) for numel, block in kinds]
        self._negated_kind_numels = [-numel for numel, _ in kinds]

    def forced_count(self, shard_size: int) -> int:
        """How many distinct ``(numel, block)`` kinds have more than ``2 * shard_size`` elements."""
        return bisect_left(self._negated_last_forced, -shard_size + 1)

    def required_multiple(self, shard_size: int) -> int:
        """The lcm ``shard_size`` must be a multiple of (alignment and the tensors > 2S)."""
        return self._lcms[self.forced_count(shard_size)]

    def next_admissible(self, shard_size: int, multiple: int = 1) -> int:
        """Smallest admissible shard size ``>= shard_size`` that is a multiple of ``multiple``."""
        candidate = max(shard_size, 1)
        while True:
            candidate = self._next_meeting_forced(candidate)
            if candidate % multiple:
                # Still meets the forced rule: past a threshold fewer tensors are forced.
                lcm = math.lcm(self.required_multiple(candidate), multiple)
                candidate = round_up(candidate, lcm)
            fix = self._first_violation_fix(candidate)
            if fix is None:
                return candidate
            candidate = fix

    def _next_meeting_forced(self, candidate: int) -> int:
        """Smallest ``S >= candidate`` with ``a | S`` and ``g | S`` for tensors above 2S."""
        while True:
            forced = self.forced_count(candidate)
            multiple = round_up(candidate, self._lcms[forced])
            # Within one threshold interval the forced set is fixed: take its first multiple
            # if it is still inside; otherwise the next interval forces fewer tensors.
            interval_end = -self._negated_last_forced[forced - 1] if forced else None
            if interval_end is None or multiple <= interval_end:
                return multiple
            candidate = interval_end + 1

    def _first_violation_fix(self, shard: int) -> int | None:
        """``None`` if every tensor meets the rule at ``shard``, else a larger size to try.

        The returned size is the smallest one that fixes the first violating tensor: grow
        until the rule holds within the same period of its ``L``, reach the next multiple of
        ``L`` (then ``g | S``), or reach the tensor's own length (then it need not cross).
        """
        longer = bisect_left(self._negated_kind_numels, -shard)
        for numel, block, step in self._kinds[:longer]:
            remainder = shard % step
            if shard % block == 0 or numel <= 2 * shard - remainder:
                continue
            grow = round_up(numel - 2 * shard + remainder, self._alignment)
            return min(shard + grow, round_up(shard + 1, step), round_up(numel, self._alignment))
        return None


def shard_size_lower_bound(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1
) -> int:
    """A shard size (elements per rank) no valid single-buffer layout can go below.

    The smallest admissible ``S`` with ``world_size * S >= aligned_payload`` and
    ``S >= max(block_sizes)``. Valid because every layout satisfies all three.
    """
    numels, block_sizes = check_plan_inputs(numels, block_sizes, world_size, alignment)
    return lower_bound_from_parts(
        aligned_payload(numels, alignment),
        max(block_sizes),
        world_size,
        AdmissibleShardSizes(numels, block_sizes, alignment),
    )


def lower_bound_from_parts(payload: int, max_block: int, world_size: int, admissible: AdmissibleShardSizes) -> int:
    """:func:`shard_size_lower_bound` from its ingredients (``payload`` already aligned)."""
    by_volume = -(-payload // world_size)
    return admissible.next_admissible(max(by_volume, max_block))


def padding_lower_bound(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1
) -> int:
    """Padding elements no single-buffer layout can go below.

    ``world_size * shard_size_lower_bound(...) - sum(numels)``; divide by ``sum(numels)`` for
    the overhead ratio that :attr:`Layout.padding_ratio` reports.
    """
    shard = shard_size_lower_bound(numels, block_sizes, world_size, alignment=alignment)
    return world_size * shard - sum(numels)

"""What no single-buffer layout can beat, and which shard sizes are worth trying.

Two facts drive everything (sizes in elements, ``S`` the shard size, ``g`` a block size):

* A block must sit inside one rank, so ``S >= g`` for every tensor.
* A tensor spanning two rank boundaries ``kS`` and ``(k+1)S`` has both at block boundaries,
  so ``S`` is a multiple of its ``g``. A tensor of more than ``2S`` elements always spans two
  boundaries (an open interval longer than ``2S`` holds at least two multiples of ``S``), so
  ``S`` must be a multiple of ``lcm(alignment, g_t for every t with e_t > 2S)``.

Call a shard size *admissible* when it is a multiple of the alignment and meets that lcm rule.
As ``S`` grows, fewer tensors exceed ``2S``, so the rule only relaxes at the thresholds
``S = ceil(e_t / 2)``; between thresholds the admissible sizes are the multiples of one lcm.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Sequence

from .layout import check_plan_inputs

__all__ = [
    "AdmissibleShardSizes",
    "aligned_payload",
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
    """Answers "the smallest admissible shard size >= S" in O(log n).

    Tensors are sorted by numel, largest first; with ``k`` of them above ``2S`` the shard size
    must be a multiple of ``lcms[k] = lcm(alignment, g of those k tensors)``.
    """

    def __init__(self, numels: Sequence[int], block_sizes: Sequence[int], alignment: int):
        order = sorted(range(len(numels)), key=lambda i: (-numels[i], i))
        # forced_above[k-1] is the largest S at which the k-th largest tensor still exceeds 2S.
        self._negated_last_forced = [-((numels[i] - 1) // 2) for i in order]
        self._lcms = [alignment]
        for i in order:
            self._lcms.append(math.lcm(self._lcms[-1], block_sizes[i]))

    def forced_count(self, shard_size: int) -> int:
        """How many tensors have more than ``2 * shard_size`` elements."""
        # Tensor k (0-based) is forced iff shard_size <= last_forced[k]; the list is decreasing.
        return bisect_left(self._negated_last_forced, -shard_size + 1)

    def required_multiple(self, shard_size: int) -> int:
        """The lcm ``shard_size`` must be a multiple of (alignment included)."""
        return self._lcms[self.forced_count(shard_size)]

    def next_admissible(self, shard_size: int) -> int:
        """Smallest admissible shard size ``>= shard_size``."""
        candidate = max(shard_size, 1)
        while True:
            forced = self.forced_count(candidate)
            multiple = round_up(candidate, self._lcms[forced])
            # Within one threshold interval the forced set is fixed: take its first multiple
            # if it is still inside; otherwise the next interval forces fewer tensors.
            interval_end = -self._negated_last_forced[forced - 1] if forced else None
            if interval_end is None or multiple <= interval_end:
                return multiple
            candidate = interval_end + 1


def shard_size_lower_bound(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1
) -> int:
    """A shard size (elements per rank) no valid single-buffer layout can go below.

    The smallest admissible ``S`` with ``world_size * S >= aligned_payload`` and
    ``S >= max(block_sizes)``. Valid because every layout satisfies all three.
    """
    numels, block_sizes = check_plan_inputs(numels, block_sizes, world_size, alignment)
    return _shard_size_lower_bound(
        numels, block_sizes, world_size, alignment,
        AdmissibleShardSizes(numels, block_sizes, alignment),
    )


def _shard_size_lower_bound(
    numels: tuple[int, ...],
    block_sizes: tuple[int, ...],
    world_size: int,
    alignment: int,
    admissible: AdmissibleShardSizes,
) -> int:
    """:func:`shard_size_lower_bound` on already validated input."""
    by_volume = -(-aligned_payload(numels, alignment) // world_size)
    return admissible.next_admissible(max(by_volume, max(block_sizes)))


def padding_lower_bound(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1
) -> int:
    """Padding elements no single-buffer layout can go below.

    ``world_size * shard_size_lower_bound(...) - sum(numels)``; divide by ``sum(numels)`` for
    the overhead ratio that :attr:`Layout.padding_ratio` reports.
    """
    shard = shard_size_lower_bound(numels, block_sizes, world_size, alignment=alignment)
    return world_size * shard - sum(numels)

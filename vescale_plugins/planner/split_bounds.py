"""What no split of a unit into at most ``k`` buffers can pad less than: the proof side of
:func:`.split.unit_plan_options` (elements throughout).

Every buffer of a split is a single-buffer layout of its tensors, so its padding is at least
:func:`.bounds.padding_lower_bound` of them; the unit's padding is at least the least sum of
those bounds over all partitions of its tensors into ``k`` parts. Two relaxations keep this
cheap and still valid:

* *Tiny tensors* (the smallest, together at most ``TINY_FRACTION`` of the payload: norms,
  biases) are left out and their elements subtracted: removing a tensor from a layout leaves
  a valid layout of the rest whose padding grew by exactly that tensor's elements.
* The bound of a part depends only on how many tensors of each *kind* (numel, block size)
  it holds, so the partition search is a dynamic programme over count vectors (a
  multiset partition), exact when it has at most ``EXACT_TRANSITIONS`` steps. Past that
  (MoE units with hundreds of experts) it falls back to the *capacity bound*: each part
  needs ``W * a`` elements, ``a`` the least admissible shard size at least its largest
  block, and all parts together at least the payload; parts are then whole kinds (a kind
  spread over several parts only raises their ``a``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from vescale_plugins.planner.bounds import AdmissibleShardSizes, aligned_payload, lower_bound_from_parts
from vescale_plugins.planner.layout import check_plan_inputs

__all__ = [
    "EXACT_TRANSITIONS",
    "TINY_FRACTION",
    "UnitKinds",
    "least_bound_partitions",
    "split_padding_lower_bound",
    "unit_kinds",
]

TINY_FRACTION = 1e-4
EXACT_TRANSITIONS = 400_000


def split_padding_lower_bound(
    numels: Sequence[int],
    block_sizes: Sequence[int],
    world_size: int,
    *,
    alignment: int = 1,
    max_buffers: int = 4,
) -> int:
    """Padding elements every split of the unit into at most ``max_buffers`` buffers has.

    A result of at least ``target * sum(numels)`` proves that no such split reaches the
    padding ratio ``target``; a smaller one proves nothing. Deterministic.
    """
    numels, block_sizes = check_plan_inputs(numels, block_sizes, world_size, alignment)
    if not isinstance(max_buffers, int) or max_buffers < 1:
        raise ValueError(f"max_buffers must be an int >= 1, got {max_buffers!r}")
    tiny, problem = unit_kinds(numels, block_sizes, world_size, alignment)
    if problem is None:
        return 0
    if problem.transitions <= EXACT_TRANSITIONS:
        bound = problem.exact(max_buffers)[-1][0]
    else:
        bound = problem.capacity(max_buffers)
    return max(0, bound - sum(numels[i] for i in tiny))


def least_bound_partitions(
    numels: tuple[int, ...],
    block_sizes: tuple[int, ...],
    world_size: int,
    alignment: int,
    max_buffers: int,
) -> tuple[tuple[int, ...], list[tuple[int, list[tuple[int, ...]]]]] | None:
    """The tiny tensors, and for every budget ``k <= max_buffers``: the bound on any split
    into at most ``k`` buffers (as :func:`split_padding_lower_bound`) and a partition of
    the other tensors (input indices) into at most ``k`` parts whose bounds sum to the
    least; ``None`` where the exact search is too large. Candidates for
    :func:`.split.unit_plan_options`: where the planner packs each part at its bound, the split
    is optimal."""
    tiny, problem = unit_kinds(numels, block_sizes, world_size, alignment)
    if problem is None or problem.transitions > EXACT_TRANSITIONS:
        return None
    tiny_elements = sum(numels[i] for i in tiny)
    partitions = [
        (max(0, bound - tiny_elements), problem.indices(numels, block_sizes, tiny, parts))
        for bound, parts in problem.exact(max_buffers)
    ]
    return tuple(sorted(tiny)), partitions


def unit_kinds(
    numels: tuple[int, ...], block_sizes: tuple[int, ...], world_size: int, alignment: int
) -> tuple[set[int], UnitKinds | None]:
    """The tiny tensors and the :class:`UnitKinds` of the others (``None`` if there are none)."""
    tiny = smallest_tensors(numels, TINY_FRACTION)
    kinds: dict[tuple[int, int], int] = {}
    for index, key in enumerate(zip(numels, block_sizes)):
        if index not in tiny:
            kinds[key] = kinds.get(key, 0) + 1
    if not kinds:
        return tiny, None
    return tiny, UnitKinds(sorted(kinds.items(), reverse=True), world_size, alignment)


def smallest_tensors(numels: tuple[int, ...], fraction: float) -> set[int]:
    """The smallest tensors whose elements sum to at most ``fraction`` of the payload."""
    budget, tiny = fraction * sum(numels), set()
    for index in sorted(range(len(numels)), key=lambda i: (numels[i], i)):
        budget -= numels[index]
        if budget < 0:
            break
        tiny.add(index)
    return tiny


class UnitKinds:
    """A unit as kinds of identical tensors with counts; parts are count vectors."""

    def __init__(self, kinds: list[tuple[tuple[int, int], int]], world_size: int, alignment: int):
        self.numels = [numel for (numel, _), _ in kinds]
        self.blocks = [block for (_, block), _ in kinds]
        self.counts = [count for _, count in kinds]
        self.world_size, self.alignment = world_size, alignment
        self._admissible: dict[tuple[int, ...], AdmissibleShardSizes] = {}
        # Steps of the exact dynamic programme: sub-vectors summed over all vectors.
        self.transitions = math.prod((c + 1) * (c + 2) // 2 for c in self.counts)

    def indices(
        self, numels: Sequence[int], block_sizes: Sequence[int], tiny: set[int], parts: Sequence[Sequence[int]]
    ) -> list[tuple[int, ...]]:
        """Count vectors as parts of input indices (tensors of a kind taken in input order)."""
        by_kind: dict[tuple[int, int], list[int]] = {}
        for index, key in enumerate(zip(numels, block_sizes)):
            if index not in tiny:
                by_kind.setdefault(key, []).append(index)
        members = [by_kind[key] for key in zip(self.numels, self.blocks)]
        taken = [0] * len(members)
        partition = []
        for counts in parts:
            part = []
            for kind, count in enumerate(counts):
                part += members[kind][taken[kind] : taken[kind] + count]
                taken[kind] += count
            partition.append(tuple(sorted(part)))
        return partition

    def part_padding(self, counts: Sequence[int]) -> int:
        """:func:`padding_lower_bound` of one part (0 for an empty one)."""
        support = tuple(k for k, c in enumerate(counts) if c)
        if not support:
            return 0
        admissible = self._admissible_for(support)
        payload = sum(c * aligned_payload([n], self.alignment) for c, n in zip(counts, self.numels))
        shard = lower_bound_from_parts(payload, max(self.blocks[k] for k in support), self.world_size, admissible)
        return self.world_size * shard - sum(c * n for c, n in zip(counts, self.numels))

    def _admissible_for(self, support: tuple[int, ...]) -> AdmissibleShardSizes:
        # Admissibility is a per-tensor rule, so it depends on the kinds present only.
        if support not in self._admissible:
            self._admissible[support] = AdmissibleShardSizes(
                [self.numels[k] for k in support],
                [self.blocks[k] for k in support],
                self.alignment,
            )
        return self._admissible[support]

    def exact(self, max_buffers: int) -> list[tuple[int, list[tuple[int, ...]]]]:
        """For every budget ``k <= max_buffers``: the least sum of part bounds over
        partitions into at most ``k`` parts, and one such partition (non-empty count
        vectors).

        Count vectors are flat mixed-radix indices, so a part ``u`` of ``v`` leaves
        ``v - u`` at index ``index(v) - index(u)``.
        """
        ranges = [range(c + 1) for c in self.counts]
        vectors = list(itertools.product(*ranges))
        strides = [math.prod(c + 1 for c in self.counts[k + 1 :]) for k in range(len(self.counts))]
        cost = [self.part_padding(v) for v in vectors]
        full = len(vectors) - 1
        levels, choices = [cost], []
        for parts in range(2, max_buffers + 1):
            previous = levels[-1]
            targets = [full] if parts == max_buffers else range(len(vectors))
            level, choice = list(previous), {}
            for v in targets:
                below = [0]
                for a, stride in zip(vectors[v], strides):
                    below = [b + i * stride for b in below for i in range(a + 1)]
                totals = [cost[u] + previous[v - u] for u in below]
                level[v] = min(totals)
                choice[v] = below[totals.index(level[v])]
            levels.append(level)
            choices.append(choice)
        results = []
        for budget in range(1, max_buffers + 1):
            partition, v = [], full
            for choice in reversed(choices[: budget - 1]):
                u = choice[v]
                if u:
                    partition.append(vectors[u])
                v -= u
            if v:
                partition.append(vectors[v])
            results.append((levels[budget - 1][full], partition))
        return results

    def capacity(self, max_buffers: int) -> int:
        """The capacity bound (module docstring) over partitions of whole kinds."""
        payload = sum(c * aligned_payload([n], self.alignment) for c, n in zip(self.counts, self.numels))
        least: int | None = None
        for labels in _partitions(len(self.counts), max_buffers):
            needed = 0
            for part in range(max(labels) + 1):
                support = tuple(k for k, label in enumerate(labels) if label == part)
                needed += self.world_size * self._admissible_for(support).next_admissible(
                    max(self.blocks[k] for k in support)
                )
            least = needed if least is None else min(least, needed)
        assert least is not None  # there is always at least one partition
        return max(least, payload) - sum(c * n for c, n in zip(self.counts, self.numels))


def _partitions(items: int, most: int):
    """Every partition of ``range(items)`` into at most ``most`` labelled-canonical parts
    (restricted growth strings)."""

    def grow(prefix: list[int], used: int):
        if len(prefix) == items:
            yield tuple(prefix)
            return
        for label in range(min(used + 1, most)):
            yield from grow(prefix + [label], max(used, label + 1))

    yield from grow([], 0)

"""Candidate splits for units with too many identical tensors for the exact search of
:mod:`.split_bounds` (MoE units with hundreds of experts): spilling a few experts.

A part's padding bound depends only on how many tensors of each kind it holds
(:meth:`.split_bounds.UnitKinds.part_padding`). Where a kind is longer than two shards its
block size must divide the shard size, so the part's shard size steps over a grid and its
bound is a sawtooth in its payload: zero just under ``W`` times a grid step. Splits of whole
block-size classes rarely land there; moving a few experts of one kind into another buffer
(a *spill*) shifts both buffers' payloads by a multiple of the expert's size until they do.
docs/planner.md works an example (Qwen3-30B-A3B at W=1024) through.

The search, for every budget ``k``: start from the ``STARTS_PER_BUDGET`` partitions of whole
classes into ``k`` parts (all classes, if fewer) whose bounds sum to the least, and from the
best split found with ``k - 1`` parts; for each kind of more than ``SMALL_COUNT`` tensors,
largest first, try every spill of ``1 <= c <= period`` of its tensors from the part holding
most of them into one other part or a new one (``period``: the count after which the
taker's payload repeats modulo ``W`` times its grid), keeping the ``SPILL_BEAM`` best splits
between kinds (a beam, not a greedy choice: many spills tie, and only some leave the
padding where a later spill removes it). Deterministic; the values are bounds of the parts
picked, not a bound on every split (that stays :func:`.split_bounds
.split_padding_lower_bound`'s job), and :func:`.split.unit_plan_options` plans each part.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from vescale_plugins.planner.split_bounds import UnitKinds, unit_kinds

__all__ = ["MAX_SPILL", "SMALL_COUNT", "SPILL_BEAM", "STARTS_PER_BUDGET", "spill_partitions"]

# Class partitions each budget's search starts from (with the best split one part fewer).
STARTS_PER_BUDGET = 3
# Kinds with more tensors than this are spilled; splits kept between kinds; most tensors
# spilled at once.
SMALL_COUNT = 8
SPILL_BEAM = 16
MAX_SPILL = 128

CountVector = tuple[int, ...]


def spill_partitions(
    numels: tuple[int, ...],
    block_sizes: tuple[int, ...],
    world_size: int,
    alignment: int,
    max_buffers: int,
) -> tuple[tuple[int, ...], list[tuple[int, list[tuple[int, ...]]]]] | None:
    """The tiny tensors (as :func:`.split_bounds.least_bound_partitions`), and for every
    budget ``k <= max_buffers``: the summed part bounds of the best split the spill search
    (module docstring) finds with at most ``k`` parts, and that split as parts of input
    indices; ``None`` if every tensor is tiny."""
    tiny, problem = unit_kinds(numels, block_sizes, world_size, alignment)
    if problem is None:
        return None
    search = _SpillSearch(problem)
    results: list[tuple[int, list[tuple[int, ...]]]] = []
    best: tuple[int, list[CountVector]] | None = None
    for budget in range(1, max_buffers + 1):
        starts = search.class_partitions(budget)
        if best is not None:
            starts.append(best[1])
        for start in starts:
            found = search.spill(start, budget)
            if best is None or found[0] < best[0]:
                best = found
        assert best is not None  # class_partitions gives at least one start
        tiny_elements = sum(numels[i] for i in tiny)
        results.append((max(0, best[0] - tiny_elements), problem.indices(numels, block_sizes, tiny, best[1])))
    return tuple(sorted(tiny)), results


class _SpillSearch:
    """Spills over splits given as count vectors, scored by their summed part bounds
    (each part's bound computed once)."""

    def __init__(self, problem: UnitKinds):
        self.problem = problem
        self._bounds: dict[CountVector, int] = {}

    def bound(self, counts: CountVector) -> int:
        if counts not in self._bounds:
            self._bounds[counts] = self.problem.part_padding(counts)
        return self._bounds[counts]

    def class_partitions(self, parts: int) -> list[list[CountVector]]:
        """The ``STARTS_PER_BUDGET`` partitions of whole block-size classes into ``parts``
        parts (all classes, if fewer) whose bounds sum to the least."""
        by_block: dict[int, list[int]] = {}
        for kind, block in enumerate(self.problem.blocks):
            by_block.setdefault(block, []).append(kind)
        classes = list(by_block.values())
        parts = min(parts, len(classes))
        candidates = []
        for labels in itertools.product(range(parts), repeat=len(classes)):
            # Canonical labelling (first use in order) visits every partition once.
            if list(dict.fromkeys(labels)) != list(range(parts)):
                continue
            vectors = [[0] * len(self.problem.counts) for _ in range(parts)]
            for label, kinds in zip(labels, classes):
                for kind in kinds:
                    vectors[label][kind] = self.problem.counts[kind]
            split = [tuple(v) for v in vectors]
            candidates.append((sum(self.bound(v) for v in split), split))
        candidates.sort()
        return [split for _, split in candidates[:STARTS_PER_BUDGET]]

    def spill(self, split: Sequence[CountVector], most: int) -> tuple[int, list[CountVector]]:
        """The best split reached from ``split`` by spilling (module docstring); ``(total,
        parts)``. Many-tensor kinds in turn, largest count first; after each, the
        ``SPILL_BEAM`` best splits so far go on to the next kind."""
        start = _canonical(split)
        beam = {start: self.total(start)}
        big = sorted(
            (k for k, count in enumerate(self.problem.counts) if count > SMALL_COUNT),
            key=lambda k: (-self.problem.counts[k], k),
        )
        for kind in big:
            grown = dict(beam)
            for parts in beam:
                for child in self._spills(parts, kind, most):
                    if child not in grown:
                        grown[child] = self.total(child)
            beam = dict(sorted(grown.items(), key=lambda item: (item[1], item[0]))[:SPILL_BEAM])
        best = min(beam.items(), key=lambda item: (item[1], item[0]))
        return best[1], list(best[0])

    def total(self, parts: Sequence[CountVector]) -> int:
        return sum(self.bound(v) for v in parts)

    def _spills(self, parts: tuple[CountVector, ...], kind: int, most: int):
        """Splits with ``1 <= c <= period`` tensors of ``kind`` moved from the part holding
        most of them to one other part (or a new one while there are fewer than ``most``):
        the taker's bound depends on its payload modulo ``W`` times its shard grid, so
        spilling more than a period changes only what the home part keeps."""
        home = max(range(len(parts)), key=lambda p: (parts[p][kind], -p))
        donor = parts[home]
        empty = (0,) * len(self.problem.counts)
        targets = [p for p in range(len(parts)) if p != home]
        if len(parts) < most:
            targets.append(len(parts))
        for target in targets:
            taker = parts[target] if target < len(parts) else empty
            others = [v for p, v in enumerate(parts) if p not in (home, target)]
            period = self._period(taker, kind)
            for moved in range(1, min(donor[kind] - 1, period) + 1):
                yield _canonical(others + [_add(donor, kind, -moved), _add(taker, kind, moved)])

    def _period(self, part: CountVector, kind: int) -> int:
        """Tensors of ``kind`` whose elements fill whole shard-grid rows of ``part`` with
        ``kind`` added (grid: lcm of the alignment and the block sizes), at most
        ``MAX_SPILL``."""
        grid = self.problem.alignment
        for k, count in enumerate(part):
            if count or k == kind:
                grid = math.lcm(grid, self.problem.blocks[k])
        row = self.problem.world_size * grid
        return min(row // math.gcd(row, self.problem.numels[kind]), MAX_SPILL)


def _canonical(parts: Sequence[CountVector]) -> tuple[CountVector, ...]:
    """Non-empty parts, sorted: one representation per split."""
    return tuple(sorted(tuple(v) for v in parts if any(v)))


def _add(vector: CountVector, kind: int, count: int) -> CountVector:
    return vector[:kind] + (vector[kind] + count,) + vector[kind + 1 :]

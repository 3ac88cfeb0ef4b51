"""Placing tensors for a fixed shard size: the feasibility test inside the planner's search.

All positions are in elements of the global buffer. For a fixed shard size ``S`` and a fixed
order, putting every tensor at its earliest valid start is optimal: the valid starts of a
tensor do not depend on what came before it, so the earliest start after an earlier cursor is
never later, and by induction every tensor ends as early as it can. A pass therefore returns
the end of the last tensor, and the order (or the rule picking the next tensor) is all a
strategy chooses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Placement",
    "TensorClass",
    "back_to_back",
    "earliest_start",
    "group_classes",
    "order_states",
    "place_best_fit",
    "place_exact",
    "place_in_order",
]


def earliest_start(cursor: int, numel: int, shard: int, alignment: int, step: int, divisible: bool) -> int | None:
    """Earliest start ``>= cursor`` where a tensor keeps every block inside one rank.

    ``step = lcm(alignment, block)``; ``divisible`` is ``shard % block == 0``. ``None`` when no
    start works for this shard size (a tensor whose blocks do not tile ``shard`` and that
    cannot get away with crossing a single rank boundary).
    """
    start = -(-cursor // alignment) * alignment
    boundary = (start // shard + 1) * shard
    if start + numel <= boundary:
        return start
    if divisible:
        # Boundaries are multiples of shard, hence of step: a start on a step multiple puts
        # every boundary the tensor crosses on one of its block boundaries.
        return -(-start // step) * step
    # Blocks do not tile a shard, so the tensor may cross one boundary only, at a block
    # boundary: the start must be congruent to that boundary modulo step.
    candidate = boundary - (boundary - start) // step * step
    if candidate < boundary and candidate + numel <= boundary + shard:
        return candidate
    if numel <= shard:
        return boundary
    # Start inside the next shard and cross the boundary after it; every later shard looks
    # the same, so if this fails the tensor fits nowhere.
    candidate = boundary + shard % step
    if candidate + numel <= boundary + 2 * shard:
        return candidate
    return None


def back_to_back(cursor: int, numel: int, shard: int, alignment: int, step: int, divisible: bool, most: int) -> int:
    """How many (up to ``most``) identical tensors fit back to back from ``cursor``, no gap.

    ``cursor`` is the end of an identical tensor just placed at its earliest start. Each
    fits with no gap if it crosses no boundary or, when its blocks tile the shard and the
    cursor is on its block grid, anywhere; this is what lets a pass place a run of experts
    in one step instead of one at a time.
    """
    if numel % alignment:
        return 0
    if divisible and cursor % step == 0 and numel % step == 0:
        return most
    next_boundary = (cursor // shard + 1) * shard
    return min(most, (next_boundary - cursor) // numel)


@dataclass(frozen=True)
class TensorClass:
    """Tensors with identical ``(numel, block)``: interchangeable for placement.

    ``members`` are their indices in input order (the order they are handed out, which keeps
    the layout deterministic); ``step = lcm(alignment, block)``.
    """

    numel: int
    block: int
    step: int
    members: tuple[int, ...]


def group_classes(numels: Sequence[int], block_sizes: Sequence[int], alignment: int) -> list[TensorClass]:
    """Group tensors by ``(numel, block)``, classes in order of first appearance."""
    members: dict[tuple[int, int], list[int]] = {}
    for index, key in enumerate(zip(numels, block_sizes)):
        members.setdefault(key, []).append(index)
    return [
        TensorClass(numel, block, math.lcm(alignment, block), tuple(indices))
        for (numel, block), indices in members.items()
    ]


@dataclass(frozen=True)
class Placement:
    """Result of one pass: ``end`` of the last tensor, or an estimate when it did not fit.

    ``offsets`` is ``None`` when the pass ran past ``limit``; ``end`` then estimates where
    the last tensor would have ended (at least ``limit + 1``), which the search uses to pick
    the next shard size to try.
    """

    end: int
    offsets: list[int] | None


def place_in_order(
    runs: Sequence[tuple[int, ...]],
    numels: Sequence[int],
    steps: Sequence[int],
    block_sizes: Sequence[int],
    shard: int,
    alignment: int,
    limit: int,
    payload_after: Sequence[int],
) -> Placement:
    """Place tensors in order, each at its earliest valid start, within ``[0, limit)``.

    The order is given as ``runs``: consecutive tensors with equal numel and block size.
    ``payload_after[k]`` is the aligned payload of the runs after ``runs[k]`` (for the
    estimate when the pass fails).
    """
    offsets = [0] * len(numels)
    cursor = 0
    for position, run in enumerate(runs):
        first = run[0]
        numel, step = numels[first], steps[first]
        divisible = shard % block_sizes[first] == 0
        placed = 0
        while placed < len(run):
            start = earliest_start(cursor, numel, shard, alignment, step, divisible)
            left = len(run) - placed
            if start is None or start + numel > limit:
                end = cursor if start is None else start
                return Placement(max(limit + 1, end + numel * left + payload_after[position]), None)
            offsets[run[placed]] = start
            cursor, placed = start + numel, placed + 1
            more = back_to_back(cursor, numel, shard, alignment, step, divisible, left - 1)
            for index in run[placed : placed + more]:
                offsets[index] = cursor
                cursor += numel
            placed += more
            if cursor > limit:
                return Placement(cursor + numel * (len(run) - placed) + payload_after[position], None)
    return Placement(cursor, offsets)


def place_best_fit(
    classes: Sequence[TensorClass],
    shard: int,
    alignment: int,
    limit: int,
    payload: int,
) -> Placement:
    """Place tensors in class priority order, detouring when the next one would waste room.

    ``classes`` come in priority order (least flexible first). The first class with tensors
    left is placed unless the gap before its earliest start exceeds its fair share of the
    slack (slack still unspent divided by the rank boundaries still ahead); then the class
    leaving the smallest gap goes instead (ties to priority). Saving the flexible tensors for
    those moments is what lets them absorb the misalignment of the rigid ones.
    ``payload`` is the aligned payload of all tensors (for the estimate).
    """
    offsets = [0] * sum(len(c.members) for c in classes)
    divisible = [shard % c.block == 0 for c in classes]
    active = list(range(len(classes)))
    taken = [0] * len(classes)
    cursor = 0
    while active:
        # Unspent slack shared over the rank boundaries still ahead.
        fair_gap = max(0, limit - cursor - payload) * shard // max(shard, limit - cursor)
        choice, start = _first_within(classes, divisible, active, cursor, fair_gap, shard, alignment)
        if start is None:
            return Placement(max(limit + 1, cursor + payload), None)
        tensor_class = classes[choice]
        numel, members = tensor_class.numel, tensor_class.members
        offsets[members[taken[choice]]] = start
        cursor, taken[choice] = start + numel, taken[choice] + 1
        if choice == active[0]:
            # The priority class keeps the turn while it needs no gap at all.
            more = back_to_back(
                cursor, numel, shard, alignment, tensor_class.step, divisible[choice], len(members) - taken[choice]
            )
            for index in members[taken[choice] : taken[choice] + more]:
                offsets[index] = cursor
                cursor += numel
            taken[choice] += more
            payload -= numel * more
        payload -= -(-numel // alignment) * alignment
        if cursor > limit:
            return Placement(cursor + payload, None)
        if taken[choice] == len(members):
            active.remove(choice)
    return Placement(cursor, offsets)


def _first_within(
    classes: Sequence[TensorClass],
    divisible: Sequence[bool],
    active: Sequence[int],
    cursor: int,
    fair_gap: int,
    shard: int,
    alignment: int,
) -> tuple[int, int | None]:
    """The first active class whose gap is within ``fair_gap``, else the smallest gap."""
    best_class, best_start = active[0], None
    for class_id in active:
        tensor_class = classes[class_id]
        start = earliest_start(cursor, tensor_class.numel, shard, alignment, tensor_class.step, divisible[class_id])
        if start is None:
            continue
        if start - cursor <= fair_gap:
            return class_id, start
        if best_start is None or start < best_start:
            best_class, best_start = class_id, start
    return best_class, best_start


def order_states(classes: Sequence[TensorClass]) -> int:
    """How many partial placements :func:`place_exact` tracks: ``prod(len(members) + 1)``."""
    return math.prod(len(c.members) + 1 for c in classes)


def place_exact(classes: Sequence[TensorClass], shard: int, alignment: int, limit: int) -> Placement:
    """The best order for this shard size, by dynamic programming over placed multisets.

    A state is how many tensors of each class are placed; its value is the smallest end
    any order of them reaches. Because the earliest valid start is monotone in the cursor, a
    smaller end dominates, so keeping one end per state is exact: the pass fits iff some
    order does. Cost ``order_states(classes) * len(classes)`` starts; callers keep it small.
    On failure the end is a sentinel above ``limit`` that carries no estimate.
    """
    radices, size = [], 1
    for tensor_class in classes:
        radices.append(size)
        size *= len(tensor_class.members) + 1
    unreached = limit + 1
    best_end, last_class = [unreached] * size, [-1] * size
    best_end[0] = 0
    divisible = [shard % c.block == 0 for c in classes]
    footprints = [-(-c.numel // alignment) * alignment for c in classes]
    remaining = sum(f * len(c.members) for f, c in zip(footprints, classes))
    counts = [0] * len(classes)
    for state in range(size):
        cursor = best_end[state]
        if cursor <= limit and -(-cursor // alignment) * alignment + remaining <= limit:
            for class_id, tensor_class in enumerate(classes):
                if counts[class_id] == len(tensor_class.members):
                    continue
                start = earliest_start(
                    cursor, tensor_class.numel, shard, alignment, tensor_class.step, divisible[class_id]
                )
                if start is None:
                    continue
                end, successor = start + tensor_class.numel, state + radices[class_id]
                if end < best_end[successor]:
                    best_end[successor], last_class[successor] = end, class_id
        remaining = _advance_counts(counts, classes, footprints, remaining)
    if best_end[-1] > limit:
        return Placement(2 * limit + 1, None)
    return Placement(best_end[-1], _trace_back(classes, radices, best_end, last_class))


def _advance_counts(
    counts: list[int], classes: Sequence[TensorClass], footprints: Sequence[int], remaining: int
) -> int:
    """Step the mixed-radix counter ``counts`` to the next state; return its remaining payload."""
    for class_id, tensor_class in enumerate(classes):
        if counts[class_id] < len(tensor_class.members):
            counts[class_id] += 1
            return remaining - footprints[class_id]
        remaining += footprints[class_id] * counts[class_id]
        counts[class_id] = 0
    return remaining


def _trace_back(
    classes: Sequence[TensorClass],
    radices: Sequence[int],
    best_end: Sequence[int],
    last_class: Sequence[int],
) -> list[int]:
    """Offsets of the best full order; each class hands out members in input order."""
    placed: list[tuple[int, int]] = []
    state = len(best_end) - 1
    while state:
        class_id = last_class[state]
        placed.append((class_id, best_end[state] - classes[class_id].numel))
        state -= radices[class_id]
    offsets = [0] * sum(len(c.members) for c in classes)
    handed_out = [0] * len(classes)
    for class_id, start in reversed(placed):
        offsets[classes[class_id].members[handed_out[class_id]]] = start
        handed_out[class_id] += 1
    return offsets

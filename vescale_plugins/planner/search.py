"""``plan_layout``: the smallest shard size the placement strategies can make work.

The search (sizes in elements, ``S`` the shard size, ``W`` the world size):

1. Try the lower bound ``S_lb`` (:mod:`.bounds`), often feasible, then the first sizes at
   or above it where a heavy block size tiles the shard (see step 4): a quick ceiling.
2. Ascend: run every strategy at ``S``; if none fits in ``W * S``, the best end ``P`` says
   how much room was missing, so jump to the next admissible size ``>= P / W`` (plus a
   growing minimum step, so pathological inputs cannot crawl).
3. Bisect between the last failure and the first success, since feasibility is not
   monotone in ``S`` and the jump may overshoot.
4. Climb again over the sizes where a heavy block size tiles the shard (its tensors then
   cross boundaries anywhere on their block grid instead of leaving alignment gaps).
5. If the answer is still noticeably above the bound and the unit has few distinct tensors,
   repeat 3-4 from the bound with the exact order search added.

The answer is the smallest feasible size seen. Every step is integer arithmetic over tuples
in a fixed order, so the result is identical on every rank, run and hash seed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from vescale_plugins.planner.bounds import AdmissibleShardSizes, aligned_payload, lower_bound_from_parts, round_up
from vescale_plugins.planner.layout import Layout, check_plan_inputs
from vescale_plugins.planner.packing import (
    Placement,
    TensorClass,
    group_classes,
    order_states,
    place_best_fit,
    place_exact,
    place_in_order,
)

__all__ = ["clear_plan_cache", "plan_layout"]

# Plans kept by the cache (a few per distinct unit and world size).
_CACHED_PLANS = 1024
# Ascent steps before the minimum step starts doubling (keeps the search O(log) long).
_PATIENT_ASCENT_STEPS = 4
# Tries per heavy block size when climbing over the sizes it tiles.
_MAX_TILED_TRIES = 8
_MAX_BISECTION_STEPS = 24
# Bisection stops once the interval is below shard / 2**14 (< 0.01 %): finer is noise.
_BISECTION_RESOLUTION_BITS = 14
# Largest (states x classes) for which the exact order search runs: a few ms of pure Python
# per shard size tried, enough for a dense block's ~10 distinct tensors.
EXACT_WORK_BUDGET = 25_000
# The exact search runs only when the heuristics' answer is more than 1/this above the bound:
# closer than 0.1 % it cannot change a padding figure that matters.
_EXACT_ABOVE_GAP = 1000

Strategy = Callable[[int, int], Placement]


def plan_layout(numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1) -> Layout:
    """Pack one buffer: offsets for every tensor and one shard size for every rank.

    Args:
        numels: elements of each tensor.
        block_sizes: elements of each tensor's smallest unit that must stay on one rank
            (1 element-wise, the row length row-wise, ``k * row length`` for k-row blocks),
            counted from the tensor's start; it need not divide the numel (the last block
            is then shorter, and a block larger than the tensor is the whole tensor).
        world_size: ranks sharing the buffer.
        alignment: elements; every offset and the shard size are multiples of it.

    Returns a :class:`Layout` with no block cut by a rank boundary, contiguous
    non-overlapping tensors and ``world_size`` equal shards. Raises ``ValueError`` on bad
    input, naming the tensor index and values. Plans are cached per process by their
    arguments (:func:`clear_plan_cache` empties the cache).
    """
    numels, block_sizes = check_plan_inputs(numels, block_sizes, world_size, alignment)
    return _plan_layout(numels, block_sizes, world_size, alignment)


def clear_plan_cache() -> None:
    """Forget cached plans (to time planning from cold, or to free memory)."""
    _plan_layout.cache_clear()


@functools.lru_cache(maxsize=_CACHED_PLANS)
def _plan_layout(numels: tuple[int, ...], block_sizes: tuple[int, ...], world_size: int, alignment: int) -> Layout:
    """:func:`plan_layout` on validated input, cached: a model's identical blocks (and the
    subsets :func:`.split.unit_plan_options` revisits) are planned once per process. ``Layout`` is
    immutable, so sharing one is safe."""
    admissible = AdmissibleShardSizes(numels, block_sizes, alignment)
    lower = lower_bound_from_parts(aligned_payload(numels, alignment), max(block_sizes), world_size, admissible)
    heuristics, exact = _strategies(numels, block_sizes, alignment)
    shard, offsets = _search(heuristics, exact, admissible, lower, world_size, numels, block_sizes)
    return Layout(numels, block_sizes, world_size, alignment, shard, tuple(offsets), lower)


def _strategies(
    numels: tuple[int, ...], block_sizes: tuple[int, ...], alignment: int
) -> tuple[list[Strategy], Strategy | None]:
    """The heuristic placement rules (cheapest, most often best first) and the exact one.

    Fixed orders: by block size, largest first (big blocks go where alignment is cheap,
    small tensors are left to fill gaps), and the input order (the paper's default).
    Best-fit (:func:`place_best_fit`): classes of identical tensors in priority order (by
    block size, or by numel), detouring to the class leaving the smallest gap whenever the
    next one would waste more than its share of the slack.
    Exact (``None`` when the unit has too many distinct tensors): the best of all orders,
    which makes the answer optimal for every shard size it is run at.
    """
    steps = [math.lcm(alignment, block) for block in block_sizes]
    count = len(numels)
    by_block = sorted(range(count), key=lambda i: (-steps[i], -numels[i], i))
    classes = group_classes(numels, block_sizes, alignment)
    payload = aligned_payload(numels, alignment)

    def fixed(order: list[int]) -> Strategy:
        runs = _runs(order, numels, block_sizes)
        after = _payload_after(runs, numels, alignment)
        return lambda shard, limit: place_in_order(runs, numels, steps, block_sizes, shard, alignment, limit, after)

    def best_fit(priority: list[TensorClass]) -> Strategy:
        return lambda shard, limit: place_best_fit(priority, shard, alignment, limit, payload)

    strategies = [
        fixed(by_block),
        best_fit(sorted(classes, key=lambda c: (-c.step, -c.numel, c.members[0]))),
        best_fit(sorted(classes, key=lambda c: (-c.numel, -c.step, c.members[0]))),
        fixed(list(range(count))),
    ]
    if order_states(classes) * len(classes) > EXACT_WORK_BUDGET:
        return strategies, None
    return strategies, lambda shard, limit: place_exact(classes, shard, alignment, limit)


def _runs(order: Sequence[int], numels: Sequence[int], block_sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Split ``order`` into maximal runs of consecutive tensors with equal numel and block."""
    runs: list[list[int]] = []
    for index in order:
        if runs and (numels[runs[-1][0]], block_sizes[runs[-1][0]]) == (numels[index], block_sizes[index]):
            runs[-1].append(index)
        else:
            runs.append([index])
    return [tuple(run) for run in runs]


def _payload_after(runs: Sequence[tuple[int, ...]], numels: Sequence[int], alignment: int) -> list[int]:
    """``result[k]`` = aligned payload of ``runs[k + 1:]``."""
    after = [0] * len(runs)
    total = 0
    for position in range(len(runs) - 1, -1, -1):
        after[position] = total
        total += len(runs[position]) * round_up(numels[runs[position][0]], alignment)
    return after


def _try(strategies: Sequence[Strategy], shard: int, world_size: int) -> Placement:
    """First strategy that fits in ``world_size * shard``, else the smallest estimated end."""
    limit = world_size * shard
    best = None
    for strategy in strategies:
        placement = strategy(shard, limit)
        if placement.offsets is not None:
            return placement
        if best is None or placement.end < best.end:
            best = placement
    assert best is not None  # there is always a heuristic strategy
    return best


def _search(
    heuristics: Sequence[Strategy],
    exact: Strategy | None,
    admissible: AdmissibleShardSizes,
    lower: int,
    world_size: int,
    numels: tuple[int, ...],
    block_sizes: tuple[int, ...],
) -> tuple[int, list[int]]:
    """Smallest feasible shard size found (see the module docstring) and its offsets."""
    heavy = _heavy_block_sizes(numels, block_sizes)
    best = None
    for candidate in sorted({lower, *(admissible.next_admissible(lower, b) for b in heavy)}):
        placement = _try(heuristics, candidate, world_size)
        if placement.offsets is not None:
            best = (candidate, placement.offsets)
            break
    if best is not None and best[0] == lower:
        return best
    failed, found = _ascend(heuristics, admissible, lower, world_size, ceiling=None if best is None else best[0])
    feasible = found or best
    assert feasible is not None  # with no ceiling, the climb goes on until a size fits
    shard, offsets = _refine(heuristics, admissible, failed, feasible, world_size, heavy, lower)
    if exact is not None and (shard - lower) * _EXACT_ABOVE_GAP > lower:
        everything = [*heuristics, exact]
        placement = _try(everything, lower, world_size)
        if placement.offsets is not None:
            return lower, placement.offsets
        shard, offsets = _refine(everything, admissible, lower, (shard, offsets), world_size, heavy, lower)
    return shard, offsets


def _refine(
    strategies: Sequence[Strategy],
    admissible: AdmissibleShardSizes,
    failed: int,
    found: tuple[int, list[int]],
    world_size: int,
    heavy_blocks: Sequence[int],
    lower: int,
) -> tuple[int, list[int]]:
    """Steps 3 and 4: bisect below a feasible size, then climb over block-tiling sizes."""
    shard, offsets = _bisect(strategies, admissible, failed, *found, world_size)
    for block in heavy_blocks:
        _, tiled = _ascend(
            strategies, admissible, lower, world_size, multiple=block, ceiling=shard, max_tries=_MAX_TILED_TRIES
        )
        if tiled is not None:
            shard, offsets = tiled
    return shard, offsets


def _ascend(
    strategies: Sequence[Strategy],
    admissible: AdmissibleShardSizes,
    shard: int,
    world_size: int,
    *,
    multiple: int = 1,
    ceiling: int | None = None,
    max_tries: int | None = None,
) -> tuple[int, tuple[int, list[int]] | None]:
    """Climb from ``shard`` over admissible multiples of ``multiple`` to the first feasible
    size below ``ceiling`` (``None`` if none within ``max_tries``); also return the last
    size that failed (``shard`` itself if nothing was tried)."""
    failed, min_step, attempt = shard, 1, 0
    while max_tries is None or attempt < max_tries:
        attempt += 1
        shard = admissible.next_admissible(shard, multiple)
        if ceiling is not None and shard >= ceiling:
            break
        placement = _try(strategies, shard, world_size)
        if placement.offsets is not None:
            return failed, (shard, placement.offsets)
        failed = shard
        if attempt > _PATIENT_ASCENT_STEPS:
            # The estimates keep falling short: grow the step geometrically from 1/4096 of
            # the shard so that any gap is crossed in a few dozen tries.
            min_step = max(2 * min_step, shard >> 12)
        shard = max(-(-placement.end // world_size), shard + min_step)
    return failed, None


def _bisect(
    strategies: Sequence[Strategy],
    admissible: AdmissibleShardSizes,
    failed: int,
    shard: int,
    offsets: list[int],
    world_size: int,
) -> tuple[int, list[int]]:
    """Look for a smaller feasible size between a failure and a success."""
    for _ in range(_MAX_BISECTION_STEPS):
        if (shard - failed) << _BISECTION_RESOLUTION_BITS < shard:
            break
        middle = admissible.next_admissible((failed + shard) // 2 + 1)
        if middle >= shard:
            break
        placement = _try(strategies, middle, world_size)
        if placement.offsets is not None:
            shard, offsets = middle, placement.offsets
        else:
            failed = middle
    return shard, offsets


def _heavy_block_sizes(numels: tuple[int, ...], block_sizes: tuple[int, ...]) -> list[int]:
    """Block sizes holding at least 1/8 of the payload, ascending (a light one saves little).

    When such a block size tiles the shard, its tensors may cross boundaries anywhere on
    their block grid, so the alignment gaps they would otherwise leave disappear.
    """
    volume_by_block: dict[int, int] = {}
    for numel, block in zip(numels, block_sizes):
        volume_by_block[block] = volume_by_block.get(block, 0) + numel
    total = sum(numels)
    return sorted(block for block, volume in volume_by_block.items() if volume * 8 >= total)

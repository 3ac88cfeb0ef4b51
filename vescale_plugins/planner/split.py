"""The least-padding splits of one FSDP unit into several buffers, per buffer budget.

In one buffer, every tensor longer than two shards forces the shard size to a multiple of its
block size, so tensors with unrelated block sizes force the lcm of them all; at large world
sizes that rounding dominates (:mod:`.bounds`). Separate buffers each get their own shard size
and their own collective. Which split:

* Atoms are the unit's block-size classes (tensors sharing a block size never force an lcm
  on each other, so they stay together). Units with more than ``MAX_ATOMS`` classes merge
  the lightest ones into one atom.
* For every buffer count ``k``, the partition of the atoms into ``k`` buffers with the least
  total padding is found exactly (dynamic programming over subsets) *as far as*
  :func:`plan_layout` *can pack each subset*. Planning all ``2**atoms`` subsets would be
  slow, so the search is lazy: a subset's padding starts as its cheap lower bound, the
  best partition under those values is computed, its unplanned subsets are planned, and
  this repeats until the best partition consists of planned subsets only (a planned value
  is never below its bound, so nothing unplanned can beat it), or until the best planned
  partition is within ``PARTITION_TOLERANCE`` of the payload of that bound (planning every
  subset to shave a few millionths of padding is not worth seconds).
* Where whole classes leave more than ``FINE_SEARCH_ABOVE`` of the payload, classes are
  split too (``_improve_by_splitting_classes``): the partition whose per-part bounds sum to
  the least (:mod:`.split_bounds`, exact over count vectors of identical tensors; for units
  with hundreds of experts, where that is too large, the split :mod:`.split_spill` finds
  by spilling up to a period of experts into other buffers) is planned, then finer atoms are
  searched for the budgets that plan does not settle.
* Which budget to use is :func:`.cost.choose_split`'s decision (NCCL's collective model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vescale_plugins.planner.bounds import padding_lower_bound
from vescale_plugins.planner.layout import Layout, check_plan_inputs
from vescale_plugins.planner.search import plan_layout
from vescale_plugins.planner.split_bounds import least_bound_partitions, smallest_tensors
from vescale_plugins.planner.split_spill import spill_partitions

__all__ = ["MAX_ATOMS", "UnitPlan", "unit_plan_options"]

# Exact partition search handles up to this many block-size classes (3**8 DP steps).
MAX_ATOMS = 8
# Stop once the best planned partition pads at most this fraction of the payload more than
# the best any partition could (by the bounds of the subsets not yet planned).
PARTITION_TOLERANCE = 1e-4
# Block-size classes are split, for budgets up to FINE_MAX_BUFFERS, only where whole
# classes leave more padding than this fraction of the payload (the 1 % target): elsewhere
# there is little to gain, and the search costs planning more subsets.
FINE_SEARCH_ABOVE = 0.01
FINE_MAX_BUFFERS = 4
# The lazy search over fine atoms stops within this fraction of the payload of its optimum
# (it plans subsets of hundreds of tensors in MoE units; 0.1 % is what the targets need).
FINE_TOLERANCE = 1e-3
# ... and stops refining once it has planned this many subsets (deterministic, unlike a
# time limit): what keeps MoE units at W in the thousands to a second.
FINE_MAX_PLANS = 24
# Tensors that together hold at most this fraction of the payload (norms, biases) form one
# fine atom.
TINY_FRACTION = 1e-3


@dataclass(frozen=True)
class UnitPlan:
    """A unit's tensors split into buffers, each with its own shard size and collective.

    ``members[b]`` are the input indices of buffer ``b``'s tensors, ascending; slot ``j`` of
    ``buffers[b]`` (its ``numels[j]``, ``offsets[j]``, ...) is tensor ``members[b][j]``.
    ``buffer_of[i]`` and ``slot_of[i]`` locate input tensor ``i``. Buffers are ordered by
    their first tensor.
    """

    buffers: tuple[Layout, ...]
    members: tuple[tuple[int, ...], ...]
    buffer_of: tuple[int, ...]
    slot_of: tuple[int, ...]

    @property
    def payload(self) -> int:
        """Elements of all tensors."""
        return sum(sum(layout.numels) for layout in self.buffers)

    @property
    def padding(self) -> int:
        """Padding elements summed over the buffers."""
        return sum(layout.padding for layout in self.buffers)

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the payload."""
        return self.padding / self.payload

    def layout_of(self, index: int) -> tuple[Layout, int]:
        """The buffer holding input tensor ``index`` and the tensor's slot in it."""
        return self.buffers[self.buffer_of[index]], self.slot_of[index]


def unit_plan_options(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1
) -> tuple[UnitPlan, ...]:
    """Least-padding plans by buffer budget: ``result[k]`` uses at most ``k + 1`` buffers.

    One entry per atom count (module docstring); padding never increases along the tuple.
    Where whole block-size classes leave more than ``FINE_SEARCH_ABOVE`` of the payload as
    padding, budgets up to ``FINE_MAX_BUFFERS`` are searched again over finer atoms
    (:func:`_fine_atoms`) and the better plan of the two is kept.
    """
    numels, block_sizes = check_plan_inputs(numels, block_sizes, world_size, alignment)
    return _unit_plan_options(numels, block_sizes, world_size, alignment)


@functools.lru_cache(maxsize=256)
def _unit_plan_options(
    numels: tuple[int, ...], block_sizes: tuple[int, ...], world_size: int, alignment: int
) -> tuple[UnitPlan, ...]:
    """:func:`unit_plan_options` on validated input, cached (plans are immutable)."""
    coarse = _PartitionSearch(
        numels, block_sizes, world_size, alignment, _merge_lightest(_classes(block_sizes), numels)
    )
    plans = [coarse.best_plan(parts) for parts in range(1, len(coarse.atoms) + 1)]
    payload = sum(numels)
    if min(p.padding for p in plans[:FINE_MAX_BUFFERS]) > FINE_SEARCH_ABOVE * payload:
        _improve_by_splitting_classes(plans, numels, block_sizes, world_size, alignment)
    best: UnitPlan | None = None
    options = []
    for plan in plans:
        if best is None or plan.padding < best.padding:
            best = plan
        options.append(best)
    return tuple(options)


def _improve_by_splitting_classes(
    plans: list[UnitPlan], numels: tuple[int, ...], block_sizes: tuple[int, ...], world_size: int, alignment: int
) -> None:
    """Replace ``plans[k - 1]`` (``k <= FINE_MAX_BUFFERS``) by better plans that split
    block-size classes: first the partitions whose bounds sum to the least, then, for
    budgets those do not settle (planned above the bound on every split), the lazy search
    over :func:`_fine_atoms` (to within ``FINE_TOLERANCE``)."""

    def offer(plan: UnitPlan) -> None:
        parts = len(plan.buffers)
        while parts > len(plans):
            plans.append(plans[-1])
        if plan.padding < plans[parts - 1].padding:
            plans[parts - 1] = plan

    tolerance = int(PARTITION_TOLERANCE * sum(numels))
    bounds = {}
    for budget, bound, plan in _bound_guided_plans(numels, block_sizes, world_size, alignment):
        offer(plan)
        if bound is not None:
            bounds[budget] = bound
    atoms = _fine_atoms(numels, block_sizes)
    unsettled = [
        k
        for k in range(2, min(FINE_MAX_BUFFERS, len(atoms)) + 1)
        if k not in bounds or min(p.padding for p in plans[:k]) > bounds[k] + tolerance
    ]
    if unsettled and sorted(atoms) != sorted(_merge_lightest(_classes(block_sizes), numels)):
        fine = _PartitionSearch(
            numels, block_sizes, world_size, alignment, atoms, tolerance=FINE_TOLERANCE, max_plans=FINE_MAX_PLANS
        )
        for parts in unsettled:
            offer(fine.best_plan(parts))


class _PartitionSearch:
    """Lazy exact search over partitions of the atoms (module docstring)."""

    def __init__(
        self,
        numels: tuple[int, ...],
        block_sizes: tuple[int, ...],
        world_size: int,
        alignment: int,
        atoms: list[tuple[int, ...]],
        tolerance: float = PARTITION_TOLERANCE,
        max_plans: int | None = None,
    ):
        self.tolerance, self.max_plans = tolerance, max_plans
        self.numels, self.block_sizes = numels, block_sizes
        self.world_size, self.alignment = world_size, alignment
        self.atoms = atoms
        self._planned: dict[int, Layout] = {}
        self._bounds: dict[int, int] = {}

    def members(self, mask: int) -> tuple[int, ...]:
        """Input indices of the atoms in ``mask``, ascending."""
        return tuple(sorted(i for bit, atom in enumerate(self.atoms) if mask >> bit & 1 for i in atom))

    def best_plan(self, parts: int) -> UnitPlan:
        """The least-padding partition into exactly ``parts`` buffers (to within
        ``tolerance``), every buffer planned; once ``max_plans`` subsets have been planned
        (over all calls), the best partition planned so far."""
        full = (1 << len(self.atoms)) - 1
        tolerance = int(self.tolerance * sum(self.numels))
        best_planned: tuple[int, list[int]] | None = None
        while True:
            optimistic, partition = _best_partition(full, parts, self._padding)
            for mask in partition:
                self._plan(mask)
            actual = sum(self._planned[mask].padding for mask in partition)
            if best_planned is None or actual < best_planned[0]:
                best_planned = (actual, partition)
            if best_planned[0] - optimistic <= tolerance or (
                self.max_plans is not None and len(self._planned) >= self.max_plans
            ):
                return self._unit_plan(best_planned[1])

    def _plan(self, mask: int) -> None:
        if mask not in self._planned:
            members = self.members(mask)
            self._planned[mask] = plan_layout(
                [self.numels[i] for i in members],
                [self.block_sizes[i] for i in members],
                self.world_size,
                alignment=self.alignment,
            )

    def _padding(self, mask: int) -> int:
        """Planned padding of a subset, or its lower bound until it is planned."""
        if mask in self._planned:
            return self._planned[mask].padding
        if mask not in self._bounds:
            members = self.members(mask)
            self._bounds[mask] = padding_lower_bound(
                [self.numels[i] for i in members],
                [self.block_sizes[i] for i in members],
                self.world_size,
                alignment=self.alignment,
            )
        return self._bounds[mask]

    def _unit_plan(self, partition: list[int]) -> UnitPlan:
        """Assemble a :class:`UnitPlan`, buffers ordered by their first tensor."""
        groups = sorted((self.members(mask), mask) for mask in partition)
        buffer_of, slot_of = [0] * len(self.numels), [0] * len(self.numels)
        for buffer, (members, _) in enumerate(groups):
            for slot, index in enumerate(members):
                buffer_of[index], slot_of[index] = buffer, slot
        return UnitPlan(
            tuple(self._planned[mask] for _, mask in groups),
            tuple(members for members, _ in groups),
            tuple(buffer_of),
            tuple(slot_of),
        )


def _bound_guided_plans(
    numels: tuple[int, ...], block_sizes: tuple[int, ...], world_size: int, alignment: int
) -> list[tuple[int, int | None, UnitPlan]]:
    """``(budget, bound, plan)`` for budgets 2 to ``FINE_MAX_BUFFERS``: the bound on any
    split and the plan of a partition whose part bounds sum to the least
    (:func:`.split_bounds.least_bound_partitions`); each part is planned, and the tiny
    tensors join the part where they add the least padding. Where that exact search is
    too large, the partitions of the spill search (:func:`.split_spill.spill_partitions`)
    instead, with ``None`` for the bound (they bound nothing)."""
    found = least_bound_partitions(numels, block_sizes, world_size, alignment, FINE_MAX_BUFFERS)
    exact = found is not None
    if not exact:
        found = spill_partitions(numels, block_sizes, world_size, alignment, FINE_MAX_BUFFERS)
    if found is None:
        return []
    tiny, partitions = found
    results = []
    for budget, (bound, partition) in enumerate(partitions[1:], start=2):
        parts = [list(part) for part in partition]
        if tiny and not parts:
            parts = [list(tiny)]
        elif tiny:
            # The tiny tensors join the part where they add the least padding (the first such).
            added = [
                _layout(numels, block_sizes, sorted(part + list(tiny)), world_size, alignment).padding
                - _layout(numels, block_sizes, part, world_size, alignment).padding
                for part in parts
            ]
            host = added.index(min(added))
            parts[host] = sorted(parts[host] + list(tiny))
        results.append(
            (
                budget,
                bound if exact else None,
                _assemble(numels, block_sizes, [tuple(p) for p in parts], world_size, alignment),
            )
        )
    return results


def _layout(numels, block_sizes, members, world_size, alignment) -> Layout:
    return plan_layout([numels[i] for i in members], [block_sizes[i] for i in members], world_size, alignment=alignment)


def _assemble(numels, block_sizes, parts: list[tuple[int, ...]], world_size: int, alignment: int) -> UnitPlan:
    """A :class:`UnitPlan` of the given parts, buffers ordered by their first tensor."""
    groups = sorted(tuple(sorted(part)) for part in parts if part)
    buffer_of, slot_of = [0] * len(numels), [0] * len(numels)
    for buffer, members in enumerate(groups):
        for slot, index in enumerate(members):
            buffer_of[index], slot_of[index] = buffer, slot
    return UnitPlan(
        tuple(_layout(numels, block_sizes, members, world_size, alignment) for members in groups),
        tuple(groups),
        tuple(buffer_of),
        tuple(slot_of),
    )


def _classes(block_sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Block-size classes in order of first appearance."""
    classes: dict[int, list[int]] = {}
    for index, block in enumerate(block_sizes):
        classes.setdefault(block, []).append(index)
    return [tuple(members) for members in classes.values()]


def _fine_atoms(numels: tuple[int, ...], block_sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Atoms that split block-size classes, for units the classes leave padded.

    Where a tensor has few blocks per rank, whole classes cannot make every buffer's
    payload a whole number of blocks per rank; moving single tensors between buffers can
    (docs/planner.md: Llama-3-8B at W=256). Tiny tensors (together at most ``TINY_FRACTION`` of the payload: norms,
    biases) form one atom. The rest: one atom per tensor when at most ``MAX_ATOMS`` - 1
    remain; else per kind of identical tensors (numel, block size), a kind of several
    tensors as one tensor plus the others, so that a buffer can take one of them. The
    lightest atoms are merged past ``MAX_ATOMS``.
    """
    tiny = smallest_tensors(numels, TINY_FRACTION)
    rest = [i for i in range(len(numels)) if i not in tiny]
    atoms: list[tuple[int, ...]]
    if len(rest) <= MAX_ATOMS - (1 if tiny else 0):
        atoms = [(i,) for i in rest]
    else:
        kinds: dict[tuple[int, int], list[int]] = {}
        for index in rest:
            kinds.setdefault((numels[index], block_sizes[index]), []).append(index)
        atoms = []
        for members in kinds.values():
            atoms += [tuple(members)] if len(members) == 1 else [(members[0],), tuple(members[1:])]
    if tiny:
        atoms.append(tuple(sorted(tiny)))
    return _merge_lightest(sorted(atoms), numels)


def _merge_lightest(atoms: list[tuple[int, ...]], numels: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``atoms`` unchanged up to ``MAX_ATOMS``; past it, the lightest merged into one."""
    if len(atoms) <= MAX_ATOMS:
        return atoms
    by_weight = sorted(atoms, key=lambda atom: (-sum(numels[i] for i in atom), atom[0]))
    rest = tuple(sorted(i for atom in by_weight[MAX_ATOMS - 1 :] for i in atom))
    return sorted([*by_weight[: MAX_ATOMS - 1], rest])


def _best_partition(full: int, parts: int, padding: Callable[[int], int]) -> tuple[int, list[int]]:
    """Least total padding of a split of ``full`` into ``parts`` non-empty subsets, and it.

    Dynamic programming over (parts, mask); the subset holding the lowest atom of ``mask``
    is enumerated, which visits every partition once. Ties keep the first found.
    """
    memo: dict[tuple[int, int], tuple[int, tuple[int, ...]] | None] = {}

    def solve(count: int, mask: int) -> tuple[int, tuple[int, ...]] | None:
        if count == 1:
            return padding(mask), (mask,)
        key = (count, mask)
        if key in memo:
            return memo[key]
        lowest = mask & -mask
        rest = mask ^ lowest
        best = None
        subset = rest
        while True:
            chosen = subset | lowest
            remainder = mask ^ chosen
            if remainder and remainder.bit_count() >= count - 1:
                tail = solve(count - 1, remainder)
                assert tail is not None  # count - 1 or more atoms split into count - 1 parts
                total = padding(chosen) + tail[0]
                if best is None or total < best[0]:
                    best = (total, (chosen, *tail[1]))
            if subset == 0:
                break
            subset = (subset - 1) & rest
        memo[key] = best
        return best

    solved = solve(parts, full)
    assert solved is not None  # callers ask for at most one part per atom
    total, masks = solved
    return total, list(masks)

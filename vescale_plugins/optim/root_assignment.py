"""Which rank orthogonalises which matrix: Newton–Schulz cost balanced over the ranks.

Pure arithmetic (no process group), so every rank computes the same assignment from the
same shapes, and the report script can run it for thousands of ranks on a laptop.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["newton_schulz_flops", "RootAssignment", "assign_roots"]


def newton_schulz_flops(shape: Sequence[int], ns_steps: int = 5) -> int:
    """Floating-point operations of ``ns_steps`` quintic Newton–Schulz iterations on a matrix.

    The iteration runs on the wide orientation ``X`` (``s x l``, ``s = min(m, n)``): per step
    ``X X^T`` (``2 s^2 l``), ``c G G + b G`` (``2 s^3``) and ``(...) X + a X`` (``2 s^2 l``),
    so ``ns_steps * (4 s^2 l + 2 s^3)``: proportional to ``m * n * min(m, n)``.
    """
    m, n = shape
    small, large = min(m, n), max(m, n)
    return ns_steps * (4 * small * small * large + 2 * small**3)


@dataclass(frozen=True)
class RootAssignment:
    """The root rank of each matrix, and each rank's summed cost (the units of ``costs``)."""

    costs: tuple[int, ...]
    roots: tuple[int, ...]
    loads: tuple[int, ...]

    @property
    def order(self) -> list[int]:
        """Matrix indices by decreasing cost, ties by index: the order they were assigned."""
        return sorted(range(len(self.costs)), key=lambda i: (-self.costs[i], i))

    def matrices_of(self, rank: int) -> list[int]:
        """Indices of the matrices rooted at ``rank``, largest first."""
        return [i for i in self.order if self.roots[i] == rank]

    @property
    def max_over_mean(self) -> float:
        """The most loaded rank's cost over the mean per rank (1.0 is perfect balance)."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0

    @property
    def lower_bound(self) -> float:
        """No assignment does better than this max/mean: ``max(1, W * largest / total)``."""
        total = sum(self.costs)
        return max(1.0, len(self.loads) * max(self.costs) / total) if total else 1.0

    @property
    def upper_bound(self) -> float:
        """List scheduling's guarantee on max/mean: ``1 + (W - 1) * largest / total``.

        The last matrix given to the most loaded rank went to the least loaded rank, whose
        load was at most the mean of the others; so max <= mean + (1 - 1/W) * largest.
        """
        total = sum(self.costs)
        return 1.0 + (len(self.loads) - 1) * max(self.costs) / total if total else 1.0


def assign_roots(costs: Sequence[int], world_size: int) -> RootAssignment:
    """Longest-processing-time-first: each matrix, largest first, to the least loaded rank.

    Deterministic (ties go to the lower matrix index, then the lower rank), so every rank
    agrees without communication. Graham: the most loaded rank carries at most
    ``4/3 - 1/(3 W)`` times the optimal assignment's most loaded rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = tuple(int(c) for c in costs)
    heap = [(0, rank) for rank in range(world_size)]
    roots = [0] * len(costs)
    loads = [0] * world_size
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        roots[i] = rank
        loads[rank] = load + costs[i]
        heapq.heappush(heap, (loads[rank], rank))
    return RootAssignment(costs, tuple(roots), tuple(loads))

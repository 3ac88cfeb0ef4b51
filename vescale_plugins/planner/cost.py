"""Is one more collective worth the padding it saves? The alpha-beta ring model, per unit.

Each buffer of a unit costs one all-gather (forward, and again in backward) and one
reduce-scatter. On a ring of ``W`` ranks each of them takes ``W - 1`` steps, each moving one
shard: ``(W - 1) * (alpha + S * bytes_per_element / beta)`` seconds for a buffer of shard size
``S`` (the same formula as :func:`vescale_plugins.forecast.comm_model.ring_collective_s`,
restated here so that the planner imports nothing outside itself). Splitting a unit adds
``W - 1`` latency steps per extra buffer and saves the padding's steps, so an extra buffer
pays exactly when it shrinks the summed shard sizes by more than
``alpha * beta / bytes_per_element`` elements per rank (:meth:`RingCost.break_even_elements`).

Parameters (documented defaults): ``alpha_s`` 10 us, the per-step latency of an NCCL ring
across nodes; ``beta_bytes_per_s`` 100 GB/s, a 400-800 Gb/s NIC per GPU; 2 bytes per element
(bf16). Inside a node (NVLink) alpha is a few us and beta several hundred GB/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vescale_plugins.planner.layout import Layout
from vescale_plugins.planner.search import plan_layout
from vescale_plugins.planner.split import UnitPlan, unit_plan_options

__all__ = ["RingCost", "choose_split"]


@dataclass(frozen=True)
class RingCost:
    """Seconds of the ring collectives over a unit's buffers (module docstring)."""

    alpha_s: float = 10e-6
    beta_bytes_per_s: float = 100e9
    bytes_per_element: int = 2

    def __post_init__(self) -> None:
        if not self.alpha_s >= 0:
            raise ValueError(f"alpha_s (seconds per ring step) must be >= 0, got {self.alpha_s}")
        if not self.beta_bytes_per_s > 0:
            raise ValueError(f"beta_bytes_per_s must be > 0, got {self.beta_bytes_per_s}")
        if not isinstance(self.bytes_per_element, int) or self.bytes_per_element <= 0:
            raise ValueError(f"bytes_per_element must be an int > 0, got {self.bytes_per_element!r}")

    def buffer_seconds(self, layout: Layout) -> float:
        """One all-gather (or reduce-scatter) of ``layout``'s buffer over its ranks."""
        steps = layout.world_size - 1
        return steps * (self.alpha_s + layout.shard_size * self.bytes_per_element / self.beta_bytes_per_s)

    def seconds(self, buffers: Sequence[Layout]) -> float:
        """One collective per buffer, summed (they run one after another on one stream)."""
        return sum(self.buffer_seconds(layout) for layout in buffers)

    def break_even_elements(self) -> float:
        """Elements per rank an extra buffer must save to pay for its latency."""
        return self.alpha_s * self.beta_bytes_per_s / self.bytes_per_element


def choose_split(
    numels: Sequence[int],
    block_sizes: Sequence[int],
    world_size: int,
    *,
    alpha_s: float = 10e-6,
    beta_bytes_per_s: float = 100e9,
    bytes_per_element: int = 2,
    alignment: int = 1,
    max_buffers: int | None = 4,
) -> UnitPlan:
    """The buffer split to use for a unit: the least-padding plan of each buffer budget
    (:func:`.split.unit_plan_options`, up to ``max_buffers``), the one the ring model says
    is fastest; ties go to fewer buffers. Arguments in elements as :func:`plan_layout`.
    At ``world_size == 1`` there is no collective, so one buffer."""
    cost = RingCost(alpha_s, beta_bytes_per_s, bytes_per_element)
    if max_buffers is not None and (not isinstance(max_buffers, int) or max_buffers < 1):
        raise ValueError(f"max_buffers must be None or an int >= 1, got {max_buffers!r}")
    single = plan_layout(numels, block_sizes, world_size, alignment=alignment)
    # Any split's shard sizes sum to at least payload / W: if one buffer is that close,
    # no split saves an extra collective's latency (and the search is skipped).
    slack = single.shard_size - sum(numels) / world_size
    if world_size == 1 or max_buffers == 1 or slack <= cost.break_even_elements():
        count = len(single.numels)
        return UnitPlan((single,), (tuple(range(count)),), (0,) * count, tuple(range(count)))
    options = unit_plan_options(numels, block_sizes, world_size, alignment=alignment)
    allowed = options if max_buffers is None else options[:max_buffers]
    return min(allowed, key=lambda plan: (cost.seconds(plan.buffers), len(plan.buffers)))

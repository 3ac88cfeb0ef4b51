"""``plan_unit``: split one FSDP unit into several buffers when the padding saved pays.

In one buffer, every tensor longer than two shards forces the shard size to a multiple of its
block size, so tensors with unrelated block sizes force the lcm of them all; at large world
sizes that rounding dominates (:mod:`.bounds`). Separate buffers each get their own shard size
and their own collective. Which split:

* Start from one buffer per distinct block size (inside one, no lcm grows).
* Merge greedily: at each step merge the two buffers whose union adds the least padding
  (often it removes padding: a buffer too small for ``world_size`` blocks pads a lot). That
  gives one candidate per buffer count, down to a single buffer.
* A merge always saves exactly one collective, so the path does not depend on the cost
  model; the cost model only picks the point on it:
  ``cost = buffers * collective_latency_s + sum(world_size * shard_size) * bytes_per_element
  / bandwidth_bytes_per_s``.

Defaults: 20 us per collective (NCCL all-gather latency at scale is tens of microseconds) and
100 GB/s (per-GPU inter-node bandwidth of a 400-800 Gb/s NIC), bf16 (2 bytes per element).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .layout import Layout, check_plan_inputs
from .search import plan_layout

__all__ = ["CostModel", "UnitPlan", "plan_unit", "unit_plan_options"]


@dataclass(frozen=True)
class CostModel:
    """Time of one collective over a buffer: a fixed latency plus bytes over bandwidth."""

    collective_latency_s: float = 20e-6
    bytes_per_element: int = 2
    bandwidth_bytes_per_s: float = 100e9

    def __post_init__(self) -> None:
        if self.collective_latency_s < 0 or self.bytes_per_element <= 0:
            raise ValueError(
                f"collective_latency_s must be >= 0 and bytes_per_element > 0, got "
                f"{self.collective_latency_s} and {self.bytes_per_element}"
            )
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")

    def seconds(self, buffers: Sequence[Layout]) -> float:
        """Modelled time of one collective per buffer, in seconds."""
        moved = sum(layout.buffer_size for layout in buffers) * self.bytes_per_element
        return len(buffers) * self.collective_latency_s + moved / self.bandwidth_bytes_per_s


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


def plan_unit(
    numels: Sequence[int],
    block_sizes: Sequence[int],
    world_size: int,
    *,
    alignment: int = 1,
    collective_latency_s: float = 20e-6,
    bytes_per_element: int = 2,
    bandwidth_bytes_per_s: float = 100e9,
    max_buffers: int | None = None,
) -> UnitPlan:
    """Plan a unit as one or more buffers, minimising the modelled collective time.

    Arguments as :func:`plan_layout` (elements), plus the cost model (module docstring) and
    ``max_buffers``, a cap on collectives per unit (``None``: no cap). Ties go to fewer
    buffers. Deterministic like :func:`plan_layout`.
    """
    cost = CostModel(collective_latency_s, bytes_per_element, bandwidth_bytes_per_s)
    if max_buffers is not None and (not isinstance(max_buffers, int) or max_buffers < 1):
        raise ValueError(f"max_buffers must be None or an int >= 1, got {max_buffers!r}")
    options = unit_plan_options(numels, block_sizes, world_size, alignment=alignment)
    allowed = options if max_buffers is None else options[:max_buffers]
    return min(allowed, key=lambda plan: (cost.seconds(plan.buffers), len(plan.buffers)))


def unit_plan_options(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, *, alignment: int = 1
) -> tuple[UnitPlan, ...]:
    """The greedy merge path: ``result[k]`` uses ``k + 1`` buffers (module docstring)."""
    numels, block_sizes = check_plan_inputs(numels, block_sizes, world_size, alignment)
    groups: dict[int, list[int]] = {}
    for index, block in enumerate(block_sizes):
        groups.setdefault(block, []).append(index)
    current = [tuple(members) for members in groups.values()]

    plans: dict[tuple[int, ...], Layout] = {}

    def layout(members: tuple[int, ...]) -> Layout:
        if members not in plans:
            plans[members] = plan_layout(
                [numels[i] for i in members], [block_sizes[i] for i in members], world_size,
                alignment=alignment,
            )
        return plans[members]

    path = [_unit_plan(current, layout, len(numels))]
    while len(current) > 1:
        first, second = min(
            ((a, b) for a in range(len(current)) for b in range(a + 1, len(current))),
            key=lambda pair: _added_padding(current, pair, layout),
        )
        merged = tuple(sorted(current[first] + current[second]))
        current = [g for k, g in enumerate(current) if k not in (first, second)] + [merged]
        path.append(_unit_plan(current, layout, len(numels)))
    return tuple(reversed(path))


def _added_padding(groups: list[tuple[int, ...]], pair: tuple[int, int], layout) -> tuple[int, int, int]:
    """Padding the merge of ``pair`` adds (negative if it saves), then the pair for ties."""
    first, second = pair
    merged = tuple(sorted(groups[first] + groups[second]))
    added = layout(merged).padding - layout(groups[first]).padding - layout(groups[second]).padding
    return added, min(groups[first]), min(groups[second])


def _unit_plan(groups: list[tuple[int, ...]], layout, count: int) -> UnitPlan:
    """Assemble a :class:`UnitPlan` from groups of input indices, buffers by first tensor."""
    ordered = sorted(groups)
    buffer_of, slot_of = [0] * count, [0] * count
    for buffer, members in enumerate(ordered):
        for slot, index in enumerate(members):
            buffer_of[index], slot_of[index] = buffer, slot
    return UnitPlan(
        tuple(layout(members) for members in ordered), tuple(ordered), tuple(buffer_of),
        tuple(slot_of),
    )

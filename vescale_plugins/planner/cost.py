"""One model of an NCCL all-gather or reduce-scatter, and the buffer split it picks.

The model is NCCL's own tuner (``src/graph/tuning.cc``, ``ncclTopoTuneModel``, NCCL 2.30.7):
for a collective of ``B`` bytes in total (the gathered buffer; the reduce-scatter's input)
over ``W`` ranks, ``n`` of them per node on ``N = ceil(W / n)`` nodes, NCCL estimates
``latency + B / algorithm bandwidth`` for every algorithm it may run and runs the fastest.
For all-gather and reduce-scatter those are:

* **Ring**, always: ``W - 1`` steps of which ``N - 1`` cross the network,
  ``base + (W - N) * intra_step + (N - 1) * inter_step + B * (W - 1) / W / bus_bw``
  (``bus_bw`` the network's when the ring leaves the node, NVLink's inside it).
* **PAT** (Parallel Aggregated Trees, NCCL >= 2.23), only with one rank per node:
  ``8 us + log2(N) * inter_step / 3.5 + 2.8 us * W + B / (0.75 * bus_bw)``; the network
  steps grow as ``log2 W``, and NCCL's model keeps a per-rank term of 2.8 us.
* Tree is NCCL's all-reduce algorithm only; NVLS and CollNet gather across nodes only with
  switch offload (SHARP); neither is modelled.

The protocol is Simple, NCCL's bandwidth protocol, for the megabyte-and-up messages of FSDP
units. Defaults: NCCL's Simple constants (``baseLatencies`` ring 8.4 us; ``hwLatencies``
NVLink ring step 3.4 us, network step 14 us) and H100 bus bandwidths with 8 GPUs per node
(80 % of NVLink 4's 450 GB/s each way; 80 % of one 400 Gb/s NIC per GPU, the figures of
``vescale_plugins.forecast.hardware``). The forecast runs the same model with its hardware's
figures (``vescale_plugins.forecast.comm_model``).

A unit's buffers each cost their own collective, one after the other on one stream, so a
split pays when the bytes it saves take longer than the latencies it adds. Memory is a second
goal the time model does not see: ``padding_cap`` (the runtime passes FSDP2's padding for the
same parameters) keeps the padding at most that, wherever at most ``max_buffers`` buffers can.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vescale_plugins.planner.layout import Layout
from vescale_plugins.planner.search import plan_layout
from vescale_plugins.planner.split import UnitPlan, unit_plan_options

__all__ = ["CollectiveCost", "choose_split"]

# PAT's constants in NCCL's tuner (tuning.cc): base latency, the divisor of its per-network-
# step latency, its per-rank latency, and its bus bandwidth relative to the ring's.
_PAT_BASE_S = 8e-6
_PAT_STEP_DIVISOR = 3.5
_PAT_PER_RANK_S = 2.8e-6
_PAT_BANDWIDTH_FACTOR = 0.75


@dataclass(frozen=True)
class CollectiveCost:
    """Seconds of one all-gather or reduce-scatter under NCCL's tuner model (module docstring).

    Fields: ``gpus_per_node`` (ranks of one group sharing a node's NVLink); ``base_latency_s``
    (per collective); ``intra_step_s``, ``inter_step_s`` (per ring step inside a node, across
    nodes); ``intra_bandwidth``, ``inter_bandwidth`` (bus bandwidth per GPU, bytes/s).
    """

    gpus_per_node: int = 8
    base_latency_s: float = 8.4e-6
    intra_step_s: float = 3.4e-6
    inter_step_s: float = 14e-6
    intra_bandwidth: float = 0.8 * 450e9
    inter_bandwidth: float = 0.8 * 50e9

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        for name in ("base_latency_s", "intra_step_s", "inter_step_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} (seconds) must be >= 0, got {getattr(self, name)}")
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} (bytes/s) must be > 0, got {getattr(self, name)}")

    def _algorithms(self, ranks: int, ranks_per_node: int | None) -> list[tuple[float, float]]:
        """``(latency_s, seconds_per_byte)`` of each algorithm NCCL may run over ``ranks``."""
        per_node = min(ranks, self.gpus_per_node if ranks_per_node is None else ranks_per_node)
        nodes = -(-ranks // per_node)
        bandwidth = self.inter_bandwidth if nodes > 1 else self.intra_bandwidth
        ring_latency = self.base_latency_s + (ranks - nodes) * self.intra_step_s + (nodes - 1) * self.inter_step_s
        algorithms = [(ring_latency, (ranks - 1) / ranks / bandwidth)]
        if per_node == 1:
            pat_latency = (
                _PAT_BASE_S + math.floor(math.log2(nodes)) * self.inter_step_s / _PAT_STEP_DIVISOR
            ) + _PAT_PER_RANK_S * ranks
            algorithms.append((pat_latency, 1 / (_PAT_BANDWIDTH_FACTOR * bandwidth)))
        return algorithms

    def seconds(self, total_bytes: float, ranks: int, ranks_per_node: int | None = None) -> float:
        """One collective of ``total_bytes`` over ``ranks`` (``ranks_per_node`` of them per
        node; default ``gpus_per_node``): NCCL's fastest algorithm. 0 for one rank."""
        if ranks <= 1:
            return 0.0
        return min(latency + total_bytes * per_byte for latency, per_byte in self._algorithms(ranks, ranks_per_node))

    def floor_seconds(self, total_bytes: float, ranks: int) -> float:
        """A lower bound of :meth:`seconds`: the least latency plus the least time per byte."""
        if ranks <= 1:
            return 0.0
        algorithms = self._algorithms(ranks, None)
        return min(a[0] for a in algorithms) + total_bytes * min(a[1] for a in algorithms)

    def unit_seconds(self, buffers: Sequence[Layout], bytes_per_element: int) -> float:
        """One collective per buffer, summed (they run one after another on one stream)."""
        return sum(self.seconds(b.buffer_size * bytes_per_element, b.world_size) for b in buffers)


def choose_split(
    numels: Sequence[int],
    block_sizes: Sequence[int],
    world_size: int,
    *,
    cost: CollectiveCost = CollectiveCost(),
    bytes_per_element: int = 2,
    alignment: int = 1,
    max_buffers: int | None = 4,
    padding_cap: int | None = None,
) -> UnitPlan:
    """The buffer split to use for a unit. Arguments in elements as :func:`plan_layout`.

    Candidates are the least-padding plans of each buffer budget up to ``max_buffers``
    (:func:`.split.unit_plan_options`). With ``padding_cap``, only those padding at most the
    cap plus what 16-byte alignment adds (``(alignment - 1)`` elements before each tensor
    and per rank at the end of each buffer) qualify; where none does, the least padding
    wins. Among the candidates, the fastest under ``cost``; ties go to fewer buffers. At
    ``world_size == 1`` there is no collective, so one buffer.
    """
    if not isinstance(bytes_per_element, int) or bytes_per_element <= 0:
        raise ValueError(f"bytes_per_element must be an int > 0, got {bytes_per_element!r}")
    if max_buffers is not None and (not isinstance(max_buffers, int) or max_buffers < 1):
        raise ValueError(f"max_buffers must be None or an int >= 1, got {max_buffers!r}")
    if padding_cap is not None and (not isinstance(padding_cap, int) or padding_cap < 0):
        raise ValueError(f"padding_cap must be None or an int >= 0 (elements), got {padding_cap!r}")

    def within_cap(plan: UnitPlan) -> bool:
        allowance = (alignment - 1) * (len(numels) + len(plan.buffers) * world_size)
        return padding_cap is None or plan.padding <= padding_cap + allowance

    single_layout = plan_layout(numels, block_sizes, world_size, alignment=alignment)
    count = len(single_layout.numels)
    single = UnitPlan((single_layout,), (tuple(range(count)),), (0,) * count, tuple(range(count)))
    if world_size == 1 or max_buffers == 1:
        return single
    # Every buffer pays at least the least latency, and all of them together move at least
    # the payload: if one buffer beats two latencies plus that, no split is faster.
    payload_bytes = sum(numels) * bytes_per_element
    if within_cap(single) and cost.unit_seconds([single_layout], bytes_per_element) <= cost.floor_seconds(
        payload_bytes, world_size
    ) + cost.floor_seconds(0, world_size):
        return single
    options = unit_plan_options(numels, block_sizes, world_size, alignment=alignment)
    allowed = list(options if max_buffers is None else options[:max_buffers])
    qualified = [plan for plan in allowed if within_cap(plan)]
    if not qualified:
        least = min(plan.padding for plan in allowed)
        qualified = [plan for plan in allowed if plan.padding == least]
    return min(qualified, key=lambda plan: (cost.unit_seconds(plan.buffers, bytes_per_element), len(plan.buffers)))

"""Step time per engine: compute, the exposed part of communication, copies, optimizer.

Per unit ``i`` in forward order, ``F_i`` and ``B_i`` are its forward and backward compute
(a third and two thirds of its training FLOPs; a checkpointed block's backward also
recomputes its forward), ``G_i`` its all-gather and ``R_i`` its reduce-scatter (plus, under
HSDP, the all-reduce of its shard across replicas). Both engines prefetch one unit ahead,
so the time communication adds to the step is:

* forward: ``G_0 + sum_i max(0, G_{i+1} - F_i)``: unit ``i + 1`` is gathered while ``i``
  computes;
* backward (units in reverse): ``G_last + sum_i max(0, G_{i-1} + R_{i+1} - B_i) + R_0``:
  while unit ``i`` computes its gradients, the next unit's gather and the previous unit's
  reduce-scatter share the network.

With ``overlaps_communication=False`` every collective adds in full. Copies run on the
compute stream and are bound by memory bandwidth (bytes read plus written): FSDP2's copy-in
(shard into the all-gather input), copy-out (all-gather output into the parameters) and
chunk-cat (gradients into the reduce-scatter input); veScale-FSDP's one copy of each
gradient into its buffer and, under mixed precision, the shard's cast. The optimizer reads
parameters, gradients and state and writes parameters and state once.

With quantized collectives (``settings.comm``) veScale-FSDP's gathers (and with
``int8-grads`` its reductions) move ``1 + 4 / quant_block`` bytes per element, and the
(de)quantization kernels' bytes count in ``copy_s`` at ``quant_bytes_per_s``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vescale_plugins.forecast.comm_model import all_reduce_s, collective_s, replica_ranks_per_node
from vescale_plugins.forecast.compute import is_block, unit_flops_per_token
from vescale_plugins.forecast.hardware import Hardware
from vescale_plugins.forecast.layouts import plan_unit_layouts
from vescale_plugins.forecast.memory import PRECISIONS, MemoryBreakdown
from vescale_plugins.forecast.model import ModelSpec
from vescale_plugins.forecast.settings import ForecastSettings

__all__ = ["StepTime", "forecast_step_time"]


@dataclass(frozen=True)
class StepTime:
    """Seconds per step of one engine on one rank, and what it means for throughput."""

    compute_s: float
    all_gather_s: float
    reduce_scatter_s: float
    exposed_comm_s: float
    copy_s: float
    optimizer_s: float
    tokens: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.copy_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second per GPU."""
        return self.tokens / self.step_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s}


def _exposed(forward: list[float], backward: list[float], gathers: list[float], reduces: list[float]) -> float:
    last = len(forward) - 1
    exposed = gathers[0] + sum(max(0.0, gathers[i + 1] - forward[i]) for i in range(last))
    exposed += gathers[last] + reduces[0]
    for i in range(last, -1, -1):
        prefetch = gathers[i - 1] if i > 0 else 0.0
        previous_reduce = reduces[i + 1] if i < last else 0.0
        exposed += max(0.0, prefetch + previous_reduce - backward[i])
    return exposed


def forecast_step_time(
    spec: ModelSpec, hardware: Hardware, group_size: int, settings: ForecastSettings, memory: dict[str, MemoryBreakdown]
) -> dict[str, StepTime]:
    """Both engines' step time per rank: ``settings.tokens_per_gpu`` per rank per step, units
    sharded over ``group_size`` ranks and replicated ``settings.replicas`` times (HSDP);
    ``memory``: both engines' (``forecast_memory``), whose state the optimizer reads."""
    replicas, tokens, block_rows = settings.replicas, settings.tokens_per_gpu, settings.block_rows
    sharded_b, compute_b, reduce_b = PRECISIONS[settings.precision]
    peak = hardware.peak_flops_bf16 if compute_b == 2 else hardware.peak_flops_fp32
    rate = peak * settings.mfu
    copy_rate = hardware.memory_bandwidth * hardware.copy_efficiency
    replica_per_node = replica_ranks_per_node(hardware, group_size)
    order = spec.forward_order()
    forward, backward = [], []
    for unit in order:
        flops = unit_flops_per_token(unit, spec.config, settings.seq_len) * tokens
        forward.append(flops / 3 / rate)
        recompute = settings.activation_checkpointing and is_block(unit)
        backward.append(flops * (2 / 3 + (1 / 3 if recompute else 0)) / rate)
    results = {}
    # Quantized collectives (veScale-FSDP only): bytes per element on the wire, int8 codes and
    # one fp32 scale per block; the kernels' bytes at their own rate.
    wire_b = 1 + 4 / settings.quant_block
    quant_rate = settings.quant_bytes_per_s or copy_rate
    for engine in ("vescale", "fsdp2"):
        gathers, reduces, copy_bytes, kernel_bytes = [], [], 0.0, 0.0
        quant_weights = engine == "vescale" and settings.comm in ("int8", "int8-grads")
        quant_grads = engine == "vescale" and settings.comm == "int8-grads"
        gather_b = wire_b if quant_weights else compute_b
        reduce_wire_b = wire_b if quant_grads else reduce_b
        for unit in order:
            layouts = plan_unit_layouts(unit, group_size, block_rows, sharded_b, compute_b)
            # One collective per buffer: FSDP2 gathers a unit in one, we in one per DBuffer.
            shards = (
                [b.layout.shard_size for b in layouts.vescale_buffers]
                if engine == "vescale"
                else [layouts.fsdp2_shard_elements]
            )
            shard = sum(shards)
            full = group_size * shard
            gather_factor = hardware.fsdp2_all_gather_factor if engine == "fsdp2" else 1.0
            reduce_factor = hardware.fsdp2_reduce_scatter_factor if engine == "fsdp2" else 1.0
            gathers.append(
                gather_factor * sum(collective_s(group_size * s * gather_b, group_size, hardware) for s in shards)
            )
            reduces.append(
                sum(
                    reduce_factor * collective_s(group_size * s * reduce_wire_b, group_size, hardware)
                    + all_reduce_s(s * reduce_b, replicas, hardware, replica_per_node)
                    for s in shards
                )
            )
            # Gradients into the reduce-scatter input: both engines, once per step.
            copy_bytes += unit.numel * compute_b + full * reduce_b
            cast = shard * (sharded_b + compute_b) if compute_b != sharded_b else 0
            if engine == "fsdp2":
                # Per gather (forward and backward): the shard into the all-gather input (with
                # its cast) and the output into the parameters.
                copy_bytes += 2 * (shard * (sharded_b + compute_b) + full * compute_b + unit.numel * compute_b)
            elif quant_weights:
                # Per gather: the shard read and its codes written; every code read and the
                # parameters written in the compute dtype (the cast is the quantization).
                kernel_bytes += 2 * (shard * (sharded_b + 1) + full * (1 + compute_b))
            else:
                copy_bytes += 2 * cast
            if quant_grads:
                # The gradients read and their codes written; every rank's codes of this shard
                # read and the sum written.
                kernel_bytes += full * (reduce_b + 1) + full + shard * reduce_b
        m = memory[engine]
        optimizer_bytes = 2 * (m.sharded_params + m.optimizer_state) + m.sharded_grads
        if hardware.overlaps_communication:
            exposed = _exposed(forward, backward, gathers, reduces)
        else:
            exposed = 2 * sum(gathers) + sum(reduces)
        results[engine] = StepTime(
            compute_s=sum(forward) + sum(backward),
            all_gather_s=2 * sum(gathers),
            reduce_scatter_s=sum(reduces),
            exposed_comm_s=exposed,
            copy_s=copy_bytes / copy_rate + kernel_bytes / quant_rate,
            optimizer_s=optimizer_bytes / copy_rate,
            tokens=tokens,
        )
    return results

"""Memory per rank, by part, for veScale-FSDP and FSDP2 (bytes).

Parts (the run record's categories, ``vescale_plugins/record.py``):

* sharded state: parameters, gradients and optimizer state each rank keeps between steps.
  veScale-FSDP keeps one sharded buffer of ``S`` elements per unit (its padding included)
  for parameters and one for gradients, in the sharded dtype (fp32); optimizer state lives
  on each parameter's local shard (padding excluded), so it differs by rank and the forecast
  reports the fullest rank. FSDP2 allocates ``ceil(dim0 / n)`` rows of every parameter on
  every rank for parameters and gradients, and rank 0 holds that many rows of optimizer
  state (the fullest rank). PyTorch's AdamW keeps a 4-byte ``step`` tensor per parameter.
* unsharded parameters: the units gathered at once. With the prefetch schedule both engines
  run (one unit ahead), two adjacent units are gathered at the worst moment. veScale-FSDP
  gathers its padded buffer (``n * S`` elements in the compute dtype); FSDP2 gathers into a
  padded all-gather output and copies out into unpadded parameters (counted here), the
  output being a communication buffer.
* unsharded gradients: one unit at a time. veScale-FSDP: its padded gradient buffer in the
  reduce dtype (fp32); both engines: autograd's gradients in the compute dtype before they
  are copied into the buffer (veScale-FSDP) or chunk-catted (FSDP2).
* communication buffers: FSDP2's all-gather output (padded, compute dtype) and its
  reduce-scatter input and output (padded, reduce dtype). veScale-FSDP's collectives work in
  place: none, but under mixed precision the shard's cast to the compute dtype.
* optimizer transient: Muon's root holds the full fp32 matrix it orthogonalises.
* activations: :mod:`.compute`'s estimate, with and without activation checkpointing.

The total is the sum of the parts' peaks: they peak together at the start of backward
(activations all saved, the last unit and its neighbour gathered, its gradients arriving),
so the sum is a slight upper bound of the true peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch.nn as nn

from vescale_plugins.dbuffer.buffer import grad_shard_elements
from vescale_plugins.forecast.layouts import UnitLayouts, buffer_rank_payloads, plan_unit_layouts
from vescale_plugins.forecast.model import ModelSpec
from vescale_plugins.observe.record import unit_sharding_figures
from vescale_plugins.runtime.state import groups_under
from vescale_plugins.tools.model_catalog import Unit

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "BUFFER_FIGURES",
    "MemoryBreakdown",
    "executed_buffer_memory",
    "forecast_memory",
    "optimizer_bytes_per_element",
    "vescale_optimizer_bytes_per_rank",
    "unit_figures",
]

OPTIMIZERS = ("adamw", "adamw8bit", "muon")
# precision -> (sharded itemsize, compute itemsize, reduce itemsize), bytes.
PRECISIONS = {"fp32": (4, 4, 4), "bf16-mixed": (4, 2, 4), "bf16": (2, 2, 2)}
ADAMW_STEP_BYTES = 4  # torch.optim.AdamW's per-parameter float32 ``step`` tensor
# AdamW8bit: two uint8 moments per element and one fp32 scale per moment per 32x32 tile.
ADAMW8BIT_BYTES_PER_ELEMENT = 2 + 2 * 4 / (32 * 32)
# Muon's root gathers the full fp32 update of a matrix and iterates Newton-Schulz on it:
# the gathered matrix, the iterate and the product of the same size.
MUON_ROOT_MATRIX_COPIES = 3
# Parameters Muon leaves to AdamW besides the 0-d/1-d ones (embeddings and the output head).
_MUON_EXCLUDED = ("embed_tokens", "lm_head")


def _is_muon_matrix(name: str, shape: Sequence[int]) -> bool:
    return (
        len(shape) >= 2
        and not any(part in name.split(".") for part in _MUON_EXCLUDED)
        and not name.startswith(_MUON_EXCLUDED)
    )


def optimizer_bytes_per_element(optimizer: str, name: str, shape: Sequence[int]) -> float:
    """Optimizer state bytes per local parameter element: AdamW 8 (two fp32 moments),
    AdamW8bit 2 + 8/1024 (uint8 moments, an fp32 scale per 32x32 tile each), Muon 4 (one
    fp32 momentum) for hidden matrices and AdamW's 8 for the rest."""
    if optimizer == "adamw":
        return 8.0
    if optimizer == "adamw8bit":
        return ADAMW8BIT_BYTES_PER_ELEMENT
    if optimizer == "muon":
        return 4.0 if _is_muon_matrix(name, shape) else 8.0
    raise ValueError(f"--optimizer {optimizer!r}: use one of {OPTIMIZERS}")


def _step_counter_bytes(unit: Unit) -> int:
    return ADAMW_STEP_BYTES * len(unit.params)


def vescale_optimizer_bytes_per_rank(
    spec: ModelSpec, group_size: int, optimizer: str = "adamw", block_rows: int | None = None
) -> list[float]:
    """Optimizer state bytes on each veScale-FSDP rank (local shards, step counters included)."""
    totals = [0.0] * group_size
    for unit in spec.units.units:
        layouts = plan_unit_layouts(unit, group_size, block_rows)
        weights = [optimizer_bytes_per_element(optimizer, name, shape) for name, shape in unit.params]
        for rank, value in enumerate(buffer_rank_payloads(layouts, weights)):
            totals[rank] += unit.count * (value + _step_counter_bytes(unit))
    return totals


def _fsdp2_rank0_optimizer_bytes(unit: Unit, layouts: UnitLayouts, optimizer: str) -> float:
    return sum(
        rows * optimizer_bytes_per_element(optimizer, name, shape)
        for (name, shape), rows in zip(unit.params, layouts.fsdp2_rank0_param_elements)
    ) + _step_counter_bytes(unit)


def unit_figures(unit: Unit, group_size: int, compute_itemsize: int, block_rows: int | None = None) -> dict[str, Any]:
    """The run record's per-unit sharding figures for veScale-FSDP's plan of ``unit``."""
    layouts = plan_unit_layouts(unit, group_size, block_rows, compute_itemsize=compute_itemsize)
    return unit_sharding_figures([(layout, compute_itemsize) for layout in layouts.vescale_layouts])


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank by part (see the module docstring); ``padding_elements`` per rank."""

    sharded_params: int
    sharded_grads: int
    optimizer_state: int
    unsharded_params: int
    unsharded_grads: int
    comm_buffers: int
    optimizer_transient: int
    activations: int
    activations_checkpointed: int
    padding_elements: int
    # The run record's library-buffer peaks (record.memory.peak_bytes_by_kind).
    unsharded_params_buffer_peak: int
    unsharded_grads_buffer_peak: int
    largest_unsharded_bytes: int

    @property
    def sharded_state(self) -> int:
        return self.sharded_params + self.sharded_grads + self.optimizer_state

    def total(self, activation_checkpointing: bool) -> int:
        activations = self.activations_checkpointed if activation_checkpointing else self.activations
        return (
            self.sharded_state
            + self.unsharded_params
            + self.unsharded_grads
            + self.comm_buffers
            + self.optimizer_transient
            + activations
        )

    def to_dict(self) -> dict[str, int]:
        return asdict(self) | {
            "sharded_state": self.sharded_state,
            "total": self.total(False),
            "total_checkpointed": self.total(True),
        }


# The MemoryBreakdown fields that are sizes of veScale-FSDP's buffers (known once sharded).
BUFFER_FIGURES = ("sharded_params", "largest_unsharded_bytes", "unsharded_grads_buffer_peak", "padding_elements")


def executed_buffer_memory(model: nn.Module, group_size: int) -> dict[str, int]:
    """``BUFFER_FIGURES`` of ``model`` as ``fully_shard`` allocated them on this rank (what
    the forecast's figures must equal; works on the meta device)."""
    units = [u.dbuffers for u in groups_under([model]) if u.dbuffers]
    return {
        "sharded_params": sum(b.sharded.numel() * b.sharded.element_size() for bs in units for b in bs),
        "largest_unsharded_bytes": max(sum(b.layout.buffer_size * b.param_dtype.itemsize for b in bs) for bs in units),
        "unsharded_grads_buffer_peak": max(
            sum(group_size * b.grad_shard_size * b.reduce_dtype.itemsize for b in bs) for bs in units
        ),
        "padding_elements": sum(b.layout.padding for bs in units for b in bs) // group_size,
    }


def _adjacent_pair_peak(sizes: Sequence[int]) -> int:
    """Largest sum of two neighbours in forward order (one unit plus its prefetch)."""
    if len(sizes) == 1:
        return sizes[0]
    return max(a + b for a, b in zip(sizes, sizes[1:]))


def _largest_muon_matrix(spec: ModelSpec) -> int:
    return max(
        (
            math.prod(shape[-2:])
            for unit in spec.units.units
            for name, shape in unit.params
            if _is_muon_matrix(name, shape)
        ),
        default=0,
    )


def forecast_memory(
    spec: ModelSpec,
    group_size: int,
    precision: str,
    optimizer: str,
    activation_bytes: tuple[int, int],
    block_rows: int | None = None,
) -> dict[str, MemoryBreakdown]:
    """Both engines' memory per rank when every unit is sharded over ``group_size`` ranks.

    ``activation_bytes``: ``(without, with)`` activation checkpointing, from
    :func:`vescale_plugins.forecast.compute.activation_bytes`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: use one of {sorted(PRECISIONS)}")
    sharded_b, compute_b, reduce_b = PRECISIONS[precision]
    order = spec.forward_order()
    layouts = {
        id(unit): plan_unit_layouts(unit, group_size, block_rows, sharded_b, compute_b) for unit in spec.units.units
    }
    n = group_size
    muon = MUON_ROOT_MATRIX_COPIES * 4 * _largest_muon_matrix(spec) if optimizer == "muon" else 0
    autograd_grads = max(unit.numel for unit in order) * compute_b

    # veScale-FSDP
    shard = sum(u.count * layouts[id(u)].vescale_shard_elements for u in spec.units.units)
    # A unit's buffers are gathered together.
    gathered = [n * layouts[id(u)].vescale_shard_elements for u in order]
    # Each rank's chunk of a buffer's unsharded gradients carries one presence flag per
    # parameter of the buffer and is rounded up to an aligned start (DBuffer's grad_shard_size).
    gathered_grads = [
        n
        * sum(
            grad_shard_elements(b.layout.shard_size, len(b.positions), reduce_b) for b in layouts[id(u)].vescale_buffers
        )
        for u in order
    ]
    vescale = MemoryBreakdown(
        sharded_params=shard * sharded_b,
        sharded_grads=shard * sharded_b,
        optimizer_state=math.ceil(max(vescale_optimizer_bytes_per_rank(spec, n, optimizer, block_rows))),
        unsharded_params=_adjacent_pair_peak(gathered) * compute_b,
        unsharded_grads=max(gathered_grads) * reduce_b + autograd_grads,
        comm_buffers=max(layouts[id(u)].vescale_shard_elements for u in order) * compute_b
        if compute_b != sharded_b
        else 0,
        optimizer_transient=muon,
        activations=activation_bytes[0],
        activations_checkpointed=activation_bytes[1],
        padding_elements=sum(u.count * layouts[id(u)].vescale_padding for u in spec.units.units) // n,
        unsharded_params_buffer_peak=_adjacent_pair_peak(gathered) * compute_b,
        unsharded_grads_buffer_peak=max(gathered_grads) * reduce_b,
        # the largest unit gathered: all its buffers at once
        largest_unsharded_bytes=max(sum(b.layout.buffer_size for b in layouts[id(u)].vescale_buffers) for u in order)
        * compute_b,
    )

    # FSDP2
    fshard = [layouts[id(u)].fsdp2_shard_elements for u in order]
    fsdp2_opt = sum(u.count * _fsdp2_rank0_optimizer_bytes(u, layouts[id(u)], optimizer) for u in spec.units.units)
    padded = [n * s for s in fshard]
    fsdp2 = MemoryBreakdown(
        sharded_params=sum(fshard) * sharded_b,
        sharded_grads=sum(fshard) * sharded_b,
        optimizer_state=math.ceil(fsdp2_opt),
        unsharded_params=_adjacent_pair_peak([u.numel for u in order]) * compute_b,
        unsharded_grads=autograd_grads,
        # The prefetched unit's all-gather output beside a unit's reduce-scatter input and output.
        comm_buffers=max(padded) * compute_b + max(p + s for p, s in zip(padded, fshard)) * reduce_b,
        optimizer_transient=muon,
        activations=activation_bytes[0],
        activations_checkpointed=activation_bytes[1],
        padding_elements=sum(u.count * layouts[id(u)].fsdp2_padding for u in spec.units.units) // n,
        unsharded_params_buffer_peak=_adjacent_pair_peak(padded) * compute_b,
        unsharded_grads_buffer_peak=max(padded) * reduce_b,
        largest_unsharded_bytes=max(padded) * compute_b,
    )
    return {"vescale": vescale, "fsdp2": fsdp2}

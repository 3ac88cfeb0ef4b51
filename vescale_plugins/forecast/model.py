"""The model the forecast sees: its FSDP units (from the catalogue, a Hugging Face
``config.json`` or a live module) and the config numbers the compute model needs."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vescale_plugins.tools.model_catalog import CATALOG, CONFIGS, ModelUnits, Unit, model_from_config

__all__ = ["ModelSpec", "resolve_model", "spec_from_modules", "is_routed_expert"]


@dataclass(frozen=True)
class ModelSpec:
    """FSDP units in forward order plus the Hugging Face config numbers (``hidden_size``,
    ``num_experts_per_tok``, ...)."""

    name: str
    units: ModelUnits
    config: dict[str, Any] = field(default_factory=dict)

    def forward_order(self) -> list[Unit]:
        """Every unit copy in the order forward runs them (identical copies repeated)."""
        return [unit for unit in self.units.units for _ in range(unit.count)]


def resolve_model(model: str) -> ModelSpec:
    """A catalogue name (``Llama-3-70B``) or the path of a Hugging Face ``config.json``."""
    if model in CATALOG:
        return ModelSpec(model, CATALOG[model], dict(CONFIGS[model]))
    if os.path.isfile(model):
        with open(model) as f:
            config = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(model))) or model
        return ModelSpec(name, model_from_config(name, config), config)
    raise ValueError(f"--model {model!r} is neither a catalogue model ({', '.join(CATALOG)}) nor a config.json file")


def spec_from_modules(name: str, units: Sequence[tuple[str, Sequence[Any]]], config: dict[str, Any]) -> ModelSpec:
    """A spec from live modules: ``units`` is ``(unit name, [modules])`` in forward order,
    each unit's parameters in ``named_parameters()`` order (what ``fully_shard`` plans),
    skipping parameters an earlier (inner) unit already holds. Adjacent identical units
    are merged into one :class:`Unit` with a count."""
    seen: set[int] = set()
    merged: list[Unit] = []
    for unit_name, modules in units:
        params = []
        for module in modules:
            for param_name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append((param_name, tuple(param.shape)))
        if not params:
            continue
        shapes = tuple(params)
        if merged and [s for _, s in merged[-1].params] == [s for _, s in shapes]:
            merged[-1] = Unit(merged[-1].name, merged[-1].count + 1, merged[-1].params)
        else:
            merged.append(Unit(unit_name, 1, shapes))
    return ModelSpec(name, ModelUnits(name, tuple(merged)), dict(config))


def is_routed_expert(param_name: str) -> bool:
    """A routed expert's parameter (``mlp.experts.3.w1``, fused ``mlp.experts.gate_up_proj``),
    not a shared expert's (``mlp.shared_experts...``): only ``top_k`` of them run per token."""
    return "experts" in param_name.split(".")

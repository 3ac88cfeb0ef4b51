"""One forecast: memory per rank and step time for both engines at each world size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vescale_plugins.forecast.compute import activation_bytes, training_flops_per_token
from vescale_plugins.forecast.hardware import Hardware
from vescale_plugins.forecast.memory import PRECISIONS, forecast_memory
from vescale_plugins.forecast.model import ModelSpec
from vescale_plugins.forecast.settings import ForecastSettings
from vescale_plugins.forecast.step_time import forecast_step_time

__all__ = ["forecast", "forecast_world_size"]

ENGINES = ("vescale", "fsdp2")


def forecast_world_size(
    spec: ModelSpec, hardware: Hardware, world_size: int, settings: ForecastSettings
) -> dict[str, Any]:
    """Memory and step time of both engines at ``world_size`` GPUs (JSON-ready)."""
    if world_size % settings.replicas:
        raise ValueError(
            f"--hsdp {settings.replicas} does not divide {world_size} GPUs; pick world sizes that are multiples of it"
        )
    group = world_size // settings.replicas
    compute_b = PRECISIONS[settings.precision][1] if settings.precision in PRECISIONS else None
    if compute_b is None:
        raise ValueError(f"--precision {settings.precision!r}: use one of {sorted(PRECISIONS)}")
    activations = activation_bytes(spec, settings.tokens_per_gpu, compute_b)
    memory = forecast_memory(spec, group, settings.precision, settings.optimizer, activations, settings.block_rows)
    steps = forecast_step_time(spec, hardware, group, settings, memory)
    usable = hardware.memory_bytes - hardware.reserved_bytes
    engines: dict[str, dict[str, Any]] = {}
    for engine in ENGINES:
        m = memory[engine]
        total = m.total(settings.activation_checkpointing)
        engines[engine] = {
            "memory": m.to_dict(),
            "peak_bytes": total,
            "oom": total > usable,
            "oom_without_checkpointing": m.total(False) > usable,
            "oom_with_checkpointing": m.total(True) > usable,
            "step": steps[engine].to_dict(),
        }
    return {
        "world_size": world_size,
        "shard_group": group,
        "replicas": settings.replicas,
        "usable_memory_bytes": usable,
        "engines": engines,
        "ratios": {
            "step_time": steps["vescale"].step_s / steps["fsdp2"].step_s,
            "throughput": steps["vescale"].tokens_per_s / steps["fsdp2"].tokens_per_s,
            "peak_memory": engines["vescale"]["peak_bytes"] / engines["fsdp2"]["peak_bytes"],
        },
    }


def forecast(
    spec: ModelSpec, hardware: Hardware, world_sizes: Sequence[int], settings: ForecastSettings
) -> dict[str, Any]:
    """The whole forecast (JSON-ready): settings, hardware, model size and one entry per W."""
    for w in world_sizes:
        if w < 1:
            raise ValueError(f"--gpus: world sizes must be positive, got {w}")
    return {
        "model": spec.name,
        "parameters": spec.units.numel,
        "flops_per_token": training_flops_per_token(spec, settings.seq_len, settings.activation_checkpointing),
        "hardware": hardware.to_dict(),
        "settings": settings.to_dict(),
        "world_sizes": [forecast_world_size(spec, hardware, w, settings) for w in world_sizes],
    }

"""What a forecast is of: how the model is trained (precision, optimizer, batch, HSDP, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ForecastSettings"]


@dataclass(frozen=True)
class ForecastSettings:
    """What is trained and how. ``tokens_per_gpu`` per step (``seq_len``-token sequences);
    ``replicas``: HSDP's replicate degree R (the shard group is ``world / R``); ``mfu``: the
    fraction of the peak matmul rate the model's own FLOPs reach."""

    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    tokens_per_gpu: int = 8192
    seq_len: int = 4096
    replicas: int = 1
    block_rows: int | None = None
    mfu: float = 0.4
    activation_checkpointing: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

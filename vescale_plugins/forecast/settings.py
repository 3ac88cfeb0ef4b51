"""What a forecast is of: how the model is trained (precision, optimizer, batch, HSDP, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ForecastSettings"]


@dataclass(frozen=True)
class ForecastSettings:
    """What is trained and how. ``tokens_per_gpu`` per step (``seq_len``-token sequences);
    ``replicas``: HSDP's replicate degree R (the shard group is ``world / R``); ``mfu``: the
    fraction of the peak matmul rate the model's own FLOPs reach. ``comm``: veScale-FSDP's
    collectives, ``"exact"``, ``"int8"`` (weights gathered as int8 blocks of ``quant_block``
    elements with an fp32 scale each) or ``"int8-grads"`` (gradients reduced so too);
    ``quant_bytes_per_s``: the (de)quantization kernels' rate over the bytes they read and
    write (None: the device's copy rate)."""

    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    tokens_per_gpu: int = 8192
    seq_len: int = 4096
    replicas: int = 1
    block_rows: int | None = None
    mfu: float = 0.4
    activation_checkpointing: bool = True
    comm: str = "exact"
    quant_block: int = 256
    quant_bytes_per_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

"""The dynamic 8-bit quantisation map of bitsandbytes and torchao, and coding with it.

``dynamic_map(signed)`` is bitsandbytes' ``create_dynamic_map`` (as torchao's
``torchao/optim/quant_utils.py`` vendors it): 256 values in [-1, 1] (signed, for the first
moment) or [0, 1] (unsigned, for the second), dense near zero. A value ``x`` already divided by
its block's absmax gets the code of the nearest map value, ties going to the larger code,
decided exactly as torchao's binary search decides it (so codes match torchao's bit for bit).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["dynamic_map", "quantize", "dequantize", "SCALE_FLOOR"]

# A block of zeros gets this scale (torchao's clip), so dividing by it is safe.
SCALE_FLOOR = 1e-12


@functools.lru_cache(maxsize=2)
def _dynamic_map_values(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> tuple[float, ...]:
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 2**total_bits
    return tuple(sorted(data))


@functools.lru_cache(maxsize=8)
def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 sorted fp32 map values (signed: [-1, 1], unsigned: [0, 1])."""
    return torch.tensor(_dynamic_map_values(signed), dtype=torch.float32, device=device)


def quantize(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes of ``normalized`` (values already divided by their block's absmax).

    torchao's rule, to the bit: ``c`` is the last map value ``<= x`` (``0`` below the map),
    rounded up to ``c + 1`` when ``x - q[c] >= (q[c + 1] - q[c]) * 0.5``.
    """
    qmap = dynamic_map(signed, normalized.device)
    x = normalized.contiguous()
    down = (torch.searchsorted(qmap, x, right=True) - 1).clamp_(0, 255)
    up = (down + 1).clamp_(max=255)
    val_down, val_up = qmap[down], qmap[up]
    return torch.where(x - val_down >= (val_up - val_down) * 0.5, up, down).to(torch.uint8)


def dequantize(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 map values of ``codes`` (multiply by the block's scale to get the value)."""
    return dynamic_map(signed, codes.device)[codes.long()]

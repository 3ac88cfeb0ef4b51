"""The dynamic 8-bit quantisation map of bitsandbytes and torchao, and coding with it.

``dynamic_map(signed)`` is bitsandbytes' ``create_dynamic_map`` (as torchao's
``torchao/optim/quant_utils.py`` vendors it): 256 values in [-1, 1] (signed, for the first
moment) or [0, 1] (unsigned, for the second), dense near zero. A value ``x`` already divided by
its block's absmax gets the code of the nearest map value, ties going to the larger code (the
same rounding as torchao's binary search); ``midpoints`` holds the 255 decision boundaries so
every implementation (torch, Triton) makes the same comparisons.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["dynamic_map", "midpoints", "quantize", "dequantize", "SCALE_FLOOR"]

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


@functools.lru_cache(maxsize=8)
def midpoints(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 255 fp32 boundaries between consecutive map values: code ``i`` covers
    ``[midpoints[i-1], midpoints[i])``."""
    values = dynamic_map(signed, device)
    return (values[:-1] + values[1:]) * 0.5


def quantize(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes of ``normalized`` (values already divided by their block's absmax)."""
    return torch.searchsorted(midpoints(signed, normalized.device), normalized.contiguous(), right=True).to(torch.uint8)


def dequantize(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 map values of ``codes`` (multiply by the block's scale to get the value)."""
    return dynamic_map(signed, codes.device)[codes.long()]

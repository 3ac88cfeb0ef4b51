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


# A float32's top bits (sign, exponent, 10 mantissa bits) name a bucket of relative width
# 2**-10, narrower than the closest pair of map values (0.35% apart near 1.0), so a bucket
# holds at most one map value and one comparison finishes the search.
_BUCKET_SHIFT = 13
_BUCKETS = 1 << (32 - _BUCKET_SHIFT)


@functools.lru_cache(maxsize=8)
def _bucket_floor_codes(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per bucket: the last map code whose value is <= the bucket's smallest float (int64)."""
    values = dynamic_map(signed, "cpu")
    buckets = torch.arange(_BUCKETS, dtype=torch.int64)
    negative = buckets >= _BUCKETS // 2
    # Smallest float of a bucket: the lowest bit pattern if positive, the highest if negative.
    low_bits = (buckets << _BUCKET_SHIFT) | torch.where(negative, (1 << _BUCKET_SHIFT) - 1, 0)
    smallest = (low_bits - (1 << 32) * (low_bits >= 1 << 31)).to(torch.int32).view(torch.float32)
    smallest = torch.nan_to_num(smallest, nan=0.0, posinf=3e38, neginf=-3e38)
    return (torch.searchsorted(values, smallest, right=True) - 1).clamp_(0, 255).to(device)


def quantize(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes of ``normalized`` (values already divided by their block's absmax).

    torchao's rule, to the bit: ``c`` is the last map value ``<= x`` (``0`` below the map),
    rounded up to ``c + 1`` when ``x - q[c] >= (q[c + 1] - q[c]) * 0.5``.
    """
    qmap = dynamic_map(signed, normalized.device)
    x = normalized.contiguous()
    bucket = (x.view(torch.int32) >> _BUCKET_SHIFT) & (_BUCKETS - 1)
    down = _bucket_floor_codes(signed, x.device)[bucket]
    # At most one map value lies in the bucket above its floor: step past it if x reached it.
    down = (down + (qmap[(down + 1).clamp_(max=255)] <= x)).clamp_(max=255)
    return (down + (x - qmap[down] >= _half_gaps(signed, x.device)[down])).to(torch.uint8)


@functools.lru_cache(maxsize=8)
def _half_gaps(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(q[c + 1] - q[c]) * 0.5`` per code, in fp32 as torchao computes it; +inf for the last
    code (nothing to round up to)."""
    values = dynamic_map(signed, device)
    gaps = (values[1:] - values[:-1]) * 0.5
    return torch.cat([gaps, torch.tensor([float("inf")], device=device)])


def dequantize(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 map values of ``codes`` (multiply by the block's scale to get the value)."""
    return dynamic_map(signed, codes.device)[codes.long()]

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


# torchao's rule rounds x up from code c (the last map value <= x) to c + 1 when
# x - q[c] >= (q[c + 1] - q[c]) * 0.5 in fp32. x - q[c] only grows with x, so each c has an
# exact fp32 threshold t[c] (the smallest x rounding up) and the code is #{c : t[c] <= x}.
# A float32's top bits (sign, exponent, 10 mantissa bits) name a bucket of relative width
# 2**-10, narrower than the closest pair of thresholds, so a bucket holds at most one: the
# code is the bucket's base count plus one comparison with that threshold.
_BUCKET_SHIFT = 13
_BUCKETS = 1 << (32 - _BUCKET_SHIFT)


@functools.lru_cache(maxsize=2)
def _round_up_thresholds(signed: bool) -> torch.Tensor:
    """``t[c]`` for c in 0..254: the smallest fp32 ``x`` with ``x - q[c] >= half_gap[c]``."""
    values = dynamic_map(signed, "cpu")
    low, half = values[:-1], (values[1:] - values[:-1]) * 0.5
    rounds_up = lambda x: (x - low) >= half  # noqa: E731 - fp32 arithmetic, as torchao's
    t = low + half  # within an ulp or two of the threshold: walk to it
    while not rounds_up(t).all():
        t = torch.where(rounds_up(t), t, torch.nextafter(t, torch.full_like(t, 2.0)))
    while True:
        lower = torch.nextafter(t, torch.full_like(t, -2.0))
        if not rounds_up(lower).any():
            return t
        t = torch.where(rounds_up(lower), lower, t)


@functools.lru_cache(maxsize=8)
def _bucket_tables(signed: bool, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Per bucket: the code of its smallest float (uint8), and the one threshold inside it
    (fp32; +inf if none)."""
    t = _round_up_thresholds(signed)
    buckets = torch.arange(_BUCKETS, dtype=torch.int64)
    negative = buckets >= _BUCKETS // 2
    span = (1 << _BUCKET_SHIFT) - 1
    # Smallest and largest float of a bucket (bit patterns grow away from zero on both sides).
    low_bits = (buckets << _BUCKET_SHIFT) | torch.where(negative, span, 0)
    high_bits = (buckets << _BUCKET_SHIFT) | torch.where(negative, 0, span)
    as_float = lambda bits: torch.nan_to_num((bits - (1 << 32) * (bits >= 1 << 31)).to(torch.int32).view(torch.float32), nan=0.0, posinf=3e38, neginf=-3e38)  # noqa: E731
    smallest, largest = as_float(low_bits), as_float(high_bits)
    base = torch.searchsorted(t, smallest, right=True)
    inside = torch.searchsorted(t, largest, right=True) - base
    assert int(inside.max()) <= 1, "a bucket holds two thresholds: lower _BUCKET_SHIFT"
    threshold = torch.where(inside == 1, t[base.clamp(max=t.numel() - 1)], torch.tensor(float("inf")))
    return base.to(torch.uint8).to(device), threshold.to(device)


def quantize(normalized: torch.Tensor, signed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes of ``normalized`` (values already divided by their block's absmax).

    torchao's rule, to the bit: ``c`` is the last map value ``<= x`` (``0`` below the map),
    rounded up to ``c + 1`` when ``x - q[c] >= (q[c + 1] - q[c]) * 0.5``. ``out``: a uint8
    tensor of ``normalized``'s size to write the codes into (returned).
    """
    x = normalized.contiguous().view(-1)
    base_table, threshold_table = _bucket_tables(signed, x.device)
    bucket = torch.bitwise_right_shift(x.view(torch.int32), _BUCKET_SHIFT)
    bucket.bitwise_and_(_BUCKETS - 1)  # the shift carried the sign bit down
    threshold = threshold_table.index_select(0, bucket)
    base = base_table.index_select(0, bucket)
    codes = torch.add(base, torch.ge(x, threshold), out=base)
    if out is None:
        return codes.view(normalized.shape)
    out.copy_(codes.view(out.shape))
    return out


def dequantize(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 map values of ``codes`` (multiply by the block's scale to get the value)."""
    return dynamic_map(signed, codes.device)[codes.long()]

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

__all__ = ["dynamic_map", "quantize", "dequantize", "bucket_table", "SCALE_FLOOR", "BUCKET_SHIFT", "BUCKETS"]

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
# 2**-10, narrower than the closest pair of thresholds, so a bucket holds at most one; its
# low 13 bits (mirrored for negative floats, so they grow with the value) place x against it.
BUCKET_SHIFT = 13
BUCKETS = 1 << (32 - BUCKET_SHIFT)
_LOW = (1 << BUCKET_SHIFT) - 1


@functools.lru_cache(maxsize=2)
def _round_up_thresholds(signed: bool) -> torch.Tensor:
    """``t[c]`` for c in 0..254: the smallest fp32 ``x`` with ``x - q[c] >= half_gap[c]``."""
    values = dynamic_map(signed, "cpu")
    low, half = values[:-1], (values[1:] - values[:-1]) * 0.5
    rounds_up = lambda x: (x - low) >= half  # fp32 arithmetic, as torchao's
    t = low + half  # within an ulp or two of the threshold: walk to it
    while not rounds_up(t).all():
        t = torch.where(rounds_up(t), t, torch.nextafter(t, torch.full_like(t, 2.0)))
    while True:
        lower = torch.nextafter(t, torch.full_like(t, -2.0))
        if not rounds_up(lower).any():
            return t
        t = torch.where(rounds_up(lower), lower, t)


def _position(bits: torch.Tensor) -> torch.Tensor:
    """A float's place in its bucket, 0.._LOW, growing with its value (int32 bit patterns)."""
    return (bits >> 31).bitwise_xor_(bits).bitwise_and_(_LOW)


@functools.lru_cache(maxsize=8)
def bucket_table(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per bucket (int32): ``(base << 13) + 8192 - position of its threshold``, ``base`` the
    thresholds below the bucket; no threshold inside: position 8192. Then a float's code is
    ``(entry + its position) >> 13``: ``base``, plus one if it reached the threshold."""
    t = _round_up_thresholds(signed)
    buckets = torch.arange(BUCKETS, dtype=torch.int64)
    negative = buckets >= BUCKETS // 2
    # Smallest and largest float of a bucket (bit patterns grow away from zero on both sides).
    to_int32 = lambda bits: (bits - (1 << 32) * (bits >= 1 << 31)).to(torch.int32)
    as_float = lambda bits: torch.nan_to_num(to_int32(bits).view(torch.float32), nan=0.0, posinf=3e38, neginf=-3e38)
    smallest = as_float((buckets << BUCKET_SHIFT) | torch.where(negative, _LOW, 0))
    largest = as_float((buckets << BUCKET_SHIFT) | torch.where(negative, 0, _LOW))
    base = torch.searchsorted(t, smallest, right=False)
    inside = torch.searchsorted(t, largest, right=True) - base
    assert int(inside.max()) <= 1, "a bucket holds two thresholds: lower BUCKET_SHIFT"
    threshold = t[base.clamp(max=t.numel() - 1)].view(torch.int32)
    position = torch.where(inside == 1, _position(threshold).to(torch.int64), 1 << BUCKET_SHIFT)
    return ((base << BUCKET_SHIFT) + (1 << BUCKET_SHIFT) - position).to(torch.int32).to(device)


def quantize(normalized: torch.Tensor, signed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes of ``normalized`` (values already divided by their block's absmax).

    torchao's rule, to the bit: ``c`` is the last map value ``<= x`` (``0`` below the map),
    rounded up to ``c + 1`` when ``x - q[c] >= (q[c + 1] - q[c]) * 0.5``. ``out``: a uint8
    tensor of ``normalized``'s size to write the codes into (returned). Seven passes over
    int32 data and one table lookup.
    """
    bits = normalized.contiguous().view(-1).view(torch.int32)
    bucket = (bits >> BUCKET_SHIFT).bitwise_and_(BUCKETS - 1)
    # The unsigned map's thresholds are all positive: negative floats' buckets hold none, so
    # their position never matters and the plain low bits do.
    position = _position(bits) if signed else bits & _LOW
    codes = bucket_table(signed, bits.device).index_select(0, bucket).add_(position).bitwise_right_shift_(BUCKET_SHIFT)
    if out is None:
        return codes.to(torch.uint8).view(normalized.shape)
    out.copy_(codes.view(out.shape))
    return out


def dequantize(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 map values of ``codes`` (multiply by the block's scale to get the value)."""
    return dynamic_map(signed, codes.device)[codes.long()]

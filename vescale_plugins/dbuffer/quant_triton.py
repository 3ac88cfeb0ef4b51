"""The block-wise int8 quantization of :mod:`.quant_kernels` in Triton: one program per segment
(block or padding), one launch per buffer and direction.

A program loops over its segment in ``BLOCK``-element steps (segments are a few hundred
elements; a row of a prime length is one segment of a whole row): one pass for the amax,
one for the codes. The loops are ``while`` loops: Triton 3.6's interpreter (torch 2.11's)
cannot take a loaded length or a scalar argument as ``range``'s bound.

Rounding half to even is the float trick ``(q + 1.5 * 2**23) - 1.5 * 2**23`` (exact for
``|q| < 2**22``, and the codes are within ``[-127, 127]`` before the clamp for every finite
block; the range is :data:`.quant_kernels.INT8_MAX`'s, spelled out), and the division is
correctly rounded (``div_rn``), so the codes and scales are the torch reference's bit for
bit. CI runs it on CPU under ``TRITON_INTERPRET=1``, on every torch release it tests.

Gathered codes sit at the start of each rank's ``chunk`` of a byte buffer: element ``e`` of
the flat buffer of ``ranks * shard`` elements is code ``(e // shard) * chunk + e % shard`` (a
segment never crosses a rank's shard, so each program computes its base once).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["dequantize_segments_triton", "dequantize_sum_segments_triton", "quantize_segments_triton"]

_BLOCK = 256
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds to an integer, half to even


@triton.jit
def _this_segment(starts_ptr, lengths_ptr, slots_ptr):
    """This program's segment: its first element, its length and its block's slot (-1: padding)."""
    segment = tl.program_id(0)
    return tl.load(starts_ptr + segment), tl.load(lengths_ptr + segment), tl.load(slots_ptr + segment)


@triton.jit
def _quantize_kernel(
    x_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    codes_ptr,
    scales_ptr,
    shard,
    source_chunk,
    codes_chunk,
    BLOCK: tl.constexpr,
):
    start, length, slot = _this_segment(starts_ptr, lengths_ptr, slots_ptr)
    source_base = (start // shard) * source_chunk + start % shard
    codes_base = (start // shard) * codes_chunk + start % shard
    lanes = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    step = 0
    while step < length:
        mask = step + lanes < length
        x = tl.load(x_ptr + source_base + step + lanes, mask=mask, other=0.0).to(tl.float32)
        # nan must win the max (tl.maximum drops it): it makes the scale nan, which the caller refuses.
        amax = tl.where(x != x, x, tl.maximum(amax, tl.abs(x)))
        step += BLOCK
    top = tl.max(amax, axis=0)
    top = tl.where(tl.sum((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), top)
    top = tl.where(slot >= 0, top, 0.0)
    scale = tl.div_rn(top, 127.0)
    divisor = tl.where(top > 0, scale, 1.0)
    step = 0
    while step < length:
        mask = step + lanes < length
        x = tl.load(x_ptr + source_base + step + lanes, mask=mask, other=0.0).to(tl.float32)
        q = tl.div_rn(x, divisor)
        q = (q + _ROUNDER) - _ROUNDER
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        q = tl.where((q != q) | (slot < 0), 0.0, q)  # nan, and padding: code 0
        tl.store(codes_ptr + codes_base + step + lanes, q.to(tl.int8), mask=mask)
        step += BLOCK
    if slot >= 0:
        tl.store(scales_ptr + slot, scale)


@triton.jit
def _round_to_bf16(value):
    """fp32 to the nearest bf16 (ties to even), as fp32: the store's conversion is then exact
    (the interpreter truncates where CUDA rounds)."""
    bits = value.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    out_ptr,
    shard,
    chunk,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start, length, slot = _this_segment(starts_ptr, lengths_ptr, slots_ptr)
    scale = tl.load(scales_ptr + tl.maximum(slot, 0))
    scale = tl.where(slot >= 0, scale, 0.0)
    code_base = (start // shard) * chunk + start % shard
    lanes = tl.arange(0, BLOCK)
    step = 0
    while step < length:
        mask = step + lanes < length
        code = tl.load(codes_ptr + code_base + step + lanes, mask=mask, other=0).to(tl.float32)
        value = code * scale
        if BF16:
            value = _round_to_bf16(value)
        tl.store(out_ptr + start + step + lanes, value.to(out_ptr.dtype.element_ty), mask=mask)
        step += BLOCK


@triton.jit
def _dequantize_sum_kernel(
    codes_ptr,
    scales_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    out_ptr,
    chunk,
    blocks_per_sender,
    senders,
    BLOCK: tl.constexpr,
):
    start, length, slot = _this_segment(starts_ptr, lengths_ptr, slots_ptr)
    lanes = tl.arange(0, BLOCK)
    step = 0
    while step < length:
        mask = step + lanes < length
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        sender = 0
        while sender < senders:
            scale = tl.load(scales_ptr + sender * blocks_per_sender + tl.maximum(slot, 0))
            scale = tl.where(slot >= 0, scale, 0.0)
            code = tl.load(codes_ptr + sender * chunk + start + step + lanes, mask=mask, other=0).to(tl.float32)
            total += code * scale
            sender += 1
        tl.store(out_ptr + start + step + lanes, total, mask=mask)
        step += BLOCK


def quantize_segments_triton(
    source: torch.Tensor,
    segments: Any,  # quant_kernels.Segments (a layer above: its tensors are read)
    codes: torch.Tensor,
    scales: torch.Tensor,
    shard: int,
    source_chunk: int,
    codes_chunk: int,
) -> None:
    """:func:`.quant_kernels.quantize_segments` in one launch."""
    scales.zero_()
    starts, lengths, slots = segments.starts, segments.lengths, segments.scale_slots
    if starts.numel():
        _quantize_kernel[(starts.numel(),)](
            source, starts, lengths, slots, codes, scales, shard, source_chunk, codes_chunk, BLOCK=_BLOCK
        )


def dequantize_segments_triton(
    codes: torch.Tensor,
    chunk: int,
    shard: int,
    scales: torch.Tensor,
    segments: Any,  # quant_kernels.Segments (a layer above: its tensors are read)
    out: torch.Tensor,
) -> None:
    """:func:`.quant_kernels.dequantize_segments` in one launch."""
    starts, lengths, scale_slots = segments.starts, segments.lengths, segments.scale_slots
    if starts.numel():
        _dequantize_kernel[(starts.numel(),)](
            codes,
            scales,
            starts,
            lengths,
            scale_slots,
            out,
            shard,
            chunk,
            BF16=out.dtype == torch.bfloat16,
            BLOCK=_BLOCK,
        )


def dequantize_sum_segments_triton(
    codes: torch.Tensor,
    chunk: int,
    scales: torch.Tensor,
    blocks_per_sender: int,
    segments: Any,  # quant_kernels.Segments (a layer above: its tensors are read)
    out: torch.Tensor,
    senders: int,
) -> None:
    """:func:`.quant_kernels.dequantize_sum_segments` in one launch (senders summed in order)."""
    starts, lengths, scale_slots = segments.starts, segments.lengths, segments.scale_slots
    if starts.numel():
        _dequantize_sum_kernel[(starts.numel(),)](
            codes, scales, starts, lengths, scale_slots, out, chunk, blocks_per_sender, senders, BLOCK=_BLOCK
        )

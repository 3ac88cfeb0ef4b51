"""Block-wise symmetric int8 quantization of a flat buffer, one pass per direction.

A flat buffer is cut into *segments*: quantization blocks and the padding between them. Each
block gets one scale, ``amax / 127`` (fp32, ``amax`` its largest magnitude), and its elements
the codes ``round(x / scale)`` (half to even, in ``[-127, 127]``; a block of zeros: scale 0,
codes 0); dequantizing is ``code * scale`` in fp32, cast to the output's dtype. Padding
segments quantize to code 0 and dequantize to 0. Every element's arithmetic depends only on
its own value and its block's amax, so a block gives the same codes wherever it lies in
whichever buffer (the exactness of the quantized gather rests on that).

A non-finite element makes its block's scale non-finite (nan or inf): the caller checks the
scales, not the elements.

Here the torch implementation (CPU, and CUDA without Triton): a handful of whole-buffer ops,
no per-parameter launch. On CUDA with Triton installed the same math runs as one kernel per
direction (:mod:`.quant_triton`).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["INT8_MAX", "dequantize_segments", "quantize_segments"]

INT8_MAX = 127


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401  (imported only to see whether it is installed)
    except ImportError:
        return False
    return True


def quantize_segments(
    source: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale_slots: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Quantize ``source`` (flat, any floating dtype) into ``codes`` (int8, its size) and
    ``scales`` (fp32).

    The segments cover ``source`` in order: segment ``i`` is ``lengths[i]`` elements from
    ``starts[i]``; ``scale_slots[i]`` is its scale's index in ``scales``, or -1 for padding.
    Scales no block writes are set to 0.
    """
    if source.is_cuda and _triton_available():
        from vescale_plugins.dbuffer.quant_triton import quantize_segments_triton

        quantize_segments_triton(source, starts, lengths, scale_slots, codes, scales)
        return
    x = source.float()
    amax = torch.segment_reduce(x.abs(), "max", lengths=lengths)
    is_block = scale_slots >= 0
    amax = torch.where(is_block, amax, 0.0)
    scale = amax / INT8_MAX
    divisor = torch.where(amax > 0, scale, 1.0)  # a block of zeros (or padding): codes 0
    quotient = x / divisor.repeat_interleave(lengths, output_size=x.numel())
    codes.copy_(quotient.round_().clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0))
    scales.zero_()
    scales[scale_slots[is_block]] = scale[is_block]


def dequantize_segments(
    codes: torch.Tensor,
    chunk: int,
    shard: int,
    scales: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out`` (flat) = ``codes * scales[scale_slots]`` per segment (0 where the slot is -1),
    computed in fp32 and cast to ``out``'s dtype.

    ``codes`` is flat int8 holding, per rank, ``shard`` codes at the start of each ``chunk``
    (a gathered buffer of ranks' packed chunks; ``chunk == shard`` for plain codes): element
    ``e`` of ``out`` is code ``(e // shard) * chunk + e % shard``. ``scales`` is flat fp32.
    """
    if out.is_cuda and _triton_available():
        from vescale_plugins.dbuffer.quant_triton import dequantize_segments_triton

        dequantize_segments_triton(codes, chunk, shard, scales, starts, lengths, scale_slots, out)
        return
    ranks = out.numel() // shard
    by_rank = codes.view(ranks, chunk)[:, :shard]
    padded = torch.cat([scales, scales.new_zeros(1)])  # slot -1: the trailing 0
    per_element = padded[scale_slots].repeat_interleave(lengths, output_size=out.numel()).view(ranks, shard)
    if out.dtype == torch.float32:
        torch.mul(per_element, by_rank, out=out.view(ranks, shard))
    else:
        out.view(ranks, shard).copy_(per_element.mul_(by_rank))

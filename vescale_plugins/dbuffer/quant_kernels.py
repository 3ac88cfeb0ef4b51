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

__all__ = ["INT8_MAX", "dequantize_segments", "dequantize_sum_segments", "quantize_segments"]

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
    *,
    shard: int | None = None,
    source_chunk: int | None = None,
    codes_chunk: int | None = None,
) -> None:
    """Quantize ``source`` (flat, any floating dtype) into ``codes`` (flat int8) and
    ``scales`` (flat fp32).

    The segments cover the buffer in order: segment ``i`` is ``lengths[i]`` elements from
    ``starts[i]``; ``scale_slots[i]`` is its scale's index in ``scales``, or -1 for padding.
    Scales no block writes are set to 0. With ``shard``, the buffer is ranks' shards of
    ``shard`` elements each at the start of a ``source_chunk`` of ``source`` and a
    ``codes_chunk`` of ``codes`` (a gradient buffer's rank chunks into packed messages);
    without, all three are the whole buffer.
    """
    shard = shard or source.numel()
    source_chunk, codes_chunk = source_chunk or shard, codes_chunk or shard
    if source.is_cuda and _triton_available():
        from vescale_plugins.dbuffer.quant_triton import quantize_segments_triton

        quantize_segments_triton(source, starts, lengths, scale_slots, codes, scales, shard, source_chunk, codes_chunk)
        return
    ranks = source.numel() // source_chunk
    x = source.view(ranks, source_chunk)[:, :shard].float().reshape(-1)
    amax = torch.segment_reduce(x.abs(), "max", lengths=lengths)
    is_block = scale_slots >= 0
    amax = torch.where(is_block, amax, 0.0)
    scale = amax / INT8_MAX
    divisor = torch.where(amax > 0, scale, 1.0)  # a block of zeros (or padding): codes 0
    quotient = x / divisor.repeat_interleave(lengths, output_size=x.numel())
    quotient = quotient.round_().clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0)
    codes.view(ranks, codes_chunk)[:, :shard].copy_(quotient.view(ranks, shard))
    scales.zero_()
    scales[scale_slots[is_block]] = scale[is_block]


def dequantize_sum_segments(
    codes: torch.Tensor,
    chunk: int,
    scales: torch.Tensor,
    blocks_per_sender: int,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out`` (flat fp32, one shard) = the sum over senders ``j`` (in order) of their
    dequantized codes: sender ``j``'s codes are the ``out.numel()`` int8 at ``j * chunk`` of
    ``codes``, its scales ``scales[j * blocks_per_sender:][scale_slots]`` (0 where -1)."""
    shard = out.numel()
    senders = codes.numel() // chunk
    if out.is_cuda and _triton_available():
        from vescale_plugins.dbuffer.quant_triton import dequantize_sum_segments_triton

        dequantize_sum_segments_triton(
            codes, chunk, scales, blocks_per_sender, starts, lengths, scale_slots, out, senders
        )
        return
    by_sender = codes.view(senders, chunk)[:, :shard]
    padded = torch.cat([scales.view(senders, blocks_per_sender), scales.new_zeros(senders, 1)], dim=1)
    per_segment = padded[:, scale_slots]  # slot -1: the trailing 0 column
    per_element = per_segment.repeat_interleave(lengths, dim=1, output_size=shard)
    out.copy_(per_element.mul_(by_sender).sum(0))


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

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

Segments come in two forms (:class:`Segments`): per segment tensors, for the Triton kernels
(one program per segment, one launch per buffer and direction: :mod:`.quant_triton`, on CUDA
with Triton installed), and *runs* of equal blocks, for the torch implementation (CPU, and
CUDA without Triton): a few ops per run over ``(blocks, block)`` views, where a run is a
stretch of blocks of one length (neighbouring parameters of one row length share one), so
their count is about the parameters' plus the ranks', never the blocks'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["INT8_MAX", "Segments", "dequantize_segments", "dequantize_sum_segments", "quantize_segments"]

INT8_MAX = 127


@dataclass(frozen=True)
class Segments:
    """The segments of a flat buffer of ranks' shards of ``shard`` elements, in order.

    ``starts``, ``lengths`` (elements) and ``scale_slots`` (the block's scale index, -1 for
    padding): int64 tensors, one entry per segment. ``runs``: the same as ``(start, blocks,
    block, tail, first_slot)`` stretches: ``blocks`` blocks of ``block`` elements from
    ``start`` with consecutive scale slots from ``first_slot``, the last ``tail`` elements
    long (``tail <= block``); padding as ``(start, 1, 0, length, -1)``. No run crosses a
    rank's shard.
    """

    starts: torch.Tensor
    lengths: torch.Tensor
    scale_slots: torch.Tensor
    runs: tuple[tuple[int, int, int, int, int], ...]

    @classmethod
    def of(cls, starts: torch.Tensor, lengths: torch.Tensor, scale_slots: torch.Tensor, shard: int) -> Segments:
        """Segments from their tensors (host int64), the runs found in one pass over them."""
        n = starts.numel()
        block = scale_slots >= 0
        new = torch.ones(n, dtype=torch.bool)
        if n > 1:
            same = (
                block[1:]
                & block[:-1]
                & (scale_slots[1:] == scale_slots[:-1] + 1)
                & (lengths[1:] == lengths[:-1])
                & (starts[1:] // shard == starts[:-1] // shard)
            )
            new[1:] = ~same
        first_index = new.nonzero().view(-1)
        counts = torch.diff(first_index, append=torch.tensor([n])).tolist()
        # Read on the host at each run's first segment only (a run holds many blocks).
        s, ln, sl = (t[first_index].tolist() for t in (starts, lengths, scale_slots))
        runs: list[tuple[int, int, int, int, int]] = []
        for start, count, length, slot in zip(s, counts, ln, sl):
            if slot < 0:
                runs.append((start, 1, 0, length, -1))
                continue
            previous = runs[-1] if runs else None
            if (  # a shorter last block: the previous run's tail
                count == 1
                and previous is not None
                and previous[2] > 0
                and previous[3] == previous[2]
                and length < previous[2]
                and previous[0] + previous[1] * previous[2] == start
                and previous[4] + previous[1] == slot
                and start // shard == previous[0] // shard
            ):
                runs[-1] = (previous[0], previous[1] + 1, previous[2], length, previous[4])
                continue
            runs.append((start, count, length, length, slot))
        return cls(starts, lengths, scale_slots, tuple(runs))

    def to(self, device: torch.device) -> Segments:
        return Segments(self.starts.to(device), self.lengths.to(device), self.scale_slots.to(device), self.runs)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401  (imported only to see whether it is installed)
    except ImportError:
        return False
    return True


# The torch path works through a run in pieces of about this many elements: its temporaries
# stay in cache instead of each being a fresh allocation the size of the run (5-10x faster on
# this CPU than whole runs; 2**16 pays twice the Python calls for no more speed).
_PIECE_ELEMENTS = 1 << 17


def _split(piece: torch.Tensor, blocks: int, block: int, tail: int) -> list[tuple[torch.Tensor, slice]]:
    """A run's elements as ``(rows, block)`` views (pieces of the full blocks, then the tail)
    with the slice of the run's scales each covers."""
    full = blocks if tail == block else blocks - 1
    rows = max(1, _PIECE_ELEMENTS // block)
    parts = [
        (piece[first * block : min(full, first + rows) * block].view(-1, block), slice(first, min(full, first + rows)))
        for first in range(0, full, rows)
    ]
    if tail != block:
        parts.append((piece[full * block : full * block + tail].view(1, tail), slice(full, full + 1)))
    return parts


def _offset(start: int, shard: int, chunk: int) -> int:
    """Where element ``start`` of the ranks' shards sits in a buffer of ranks' ``chunk``s."""
    return start // shard * chunk + start % shard


def quantize_segments(
    source: torch.Tensor,
    segments: Segments,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    shard: int | None = None,
    source_chunk: int | None = None,
    codes_chunk: int | None = None,
) -> None:
    """Quantize ``source`` (flat, any floating dtype) into ``codes`` (flat int8) and
    ``scales`` (flat fp32; each block's at its scale slot, the rest 0).

    With ``shard``, the buffer is ranks' shards of ``shard`` elements each at the start of a
    ``source_chunk`` of ``source`` and a ``codes_chunk`` of ``codes`` (a gradient buffer's
    rank chunks into packed messages); without, all three are the whole buffer.
    """
    shard = shard or source.numel()
    source_chunk, codes_chunk = source_chunk or shard, codes_chunk or shard
    if source.is_cuda and _triton_available():
        from vescale_plugins.dbuffer.quant_triton import quantize_segments_triton

        quantize_segments_triton(source, segments, codes, scales, shard, source_chunk, codes_chunk)
        return
    scales.zero_()
    for start, blocks, block, tail, first_slot in segments.runs:
        length = (blocks - 1) * block + tail
        at, code_at = _offset(start, shard, source_chunk), _offset(start, shard, codes_chunk)
        if first_slot < 0:
            codes[code_at : code_at + length].zero_()
            continue
        x = source[at : at + length].float()
        out = codes[code_at : code_at + length]
        run_scales = scales[first_slot : first_slot + blocks]
        for (values, rows), (code_view, _) in zip(_split(x, blocks, block, tail), _split(out, blocks, block, tail)):
            amax = values.abs().amax(1, keepdim=True)
            scale = amax / INT8_MAX
            quotient = values / torch.where(amax > 0, scale, 1.0)  # a block of zeros: codes 0
            code_view.copy_(quotient.round_().clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0))
            run_scales[rows] = scale.view(-1)


def dequantize_sum_segments(
    codes: torch.Tensor,
    chunk: int,
    scales: torch.Tensor,
    blocks_per_sender: int,
    segments: Segments,
    out: torch.Tensor,
) -> None:
    """``out`` (flat fp32, one shard) = the sum over senders ``j`` (in order) of their
    dequantized codes: sender ``j``'s codes are the ``out.numel()`` int8 at ``j * chunk`` of
    ``codes``, its scales ``scales[j * blocks_per_sender:][scale_slots]`` (0 where -1)."""
    shard = out.numel()
    senders = codes.numel() // chunk
    if out.is_cuda and _triton_available():
        from vescale_plugins.dbuffer.quant_triton import dequantize_sum_segments_triton

        dequantize_sum_segments_triton(codes, chunk, scales, blocks_per_sender, segments, out, senders)
        return
    by_sender = codes.view(senders, chunk)[:, :shard]
    scales_by_sender = scales.view(senders, blocks_per_sender)
    for start, blocks, block, tail, first_slot in segments.runs:
        length = (blocks - 1) * block + tail
        if first_slot < 0:
            out[start : start + length].zero_()
            continue
        run_scales = scales_by_sender[:, first_slot : first_slot + blocks]
        piece = by_sender[:, start : start + length]
        target = out[start : start + length]
        for target_view, rows in _split(target, blocks, block, tail):
            columns = slice(rows.start * block, rows.start * block + target_view.numel())
            codes_view = piece[:, columns].reshape(senders, *target_view.shape).float()
            target_view.copy_(codes_view.mul_(run_scales[:, rows, None]).sum(0))


def dequantize_segments(
    codes: torch.Tensor,
    chunk: int,
    shard: int,
    scales: torch.Tensor,
    segments: Segments,
    out: torch.Tensor,
) -> None:
    """``out`` (flat) = ``codes * scales[scale_slots]`` per segment (0 for padding),
    computed in fp32 and cast to ``out``'s dtype.

    ``codes`` is flat int8 holding, per rank, ``shard`` codes at the start of each ``chunk``
    (a gathered buffer of ranks' packed chunks; ``chunk == shard`` for plain codes): element
    ``e`` of ``out`` is code ``(e // shard) * chunk + e % shard``. ``scales`` is flat fp32.
    """
    if out.is_cuda and _triton_available():
        from vescale_plugins.dbuffer.quant_triton import dequantize_segments_triton

        dequantize_segments_triton(codes, chunk, shard, scales, segments, out)
        return
    for start, blocks, block, tail, first_slot in segments.runs:
        length = (blocks - 1) * block + tail
        target = out[start : start + length]
        if first_slot < 0:
            target.zero_()
            continue
        code_at = _offset(start, shard, chunk)
        run_scales = scales[first_slot : first_slot + blocks]
        pieces = zip(
            _split(codes[code_at : code_at + length], blocks, block, tail), _split(target, blocks, block, tail)
        )
        for (code_view, rows), (target_view, _) in pieces:
            values = code_view.float().mul_(run_scales[rows].view(-1, 1))
            target_view.copy_(values)

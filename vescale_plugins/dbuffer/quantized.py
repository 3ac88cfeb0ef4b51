"""The int8 collectives of a DBuffer: the parameters' all-gather (each rank quantizes its own
shard's blocks, the ranks gather codes and scales, and every rank dequantizes the whole buffer
in place) and the gradients' reduction through an all-to-all (:class:`QuantizedGradReduce`).

Quantization blocks are runs of :func:`.planning.quantization_block` elements of each
parameter, counted from its first element, and the planner was asked for blocks that are
multiples of them (``plan_buffers(quant_block=...)``): no block straddles two ranks. So a
rank quantizes exactly the blocks it holds, and the gathered parameters equal the block-wise
quantization of each whole parameter at every world size and every uneven cut.

Each rank sends one packed byte chunk: its shard's codes (``S`` int8), then its blocks'
scales (fp32, as many slots as the rank with the most blocks has, unused ones 0), both
16-byte aligned. One all-gather moves all chunks; codes and scales are read in place from
the gathered bytes. About ``1 + 4 / block`` bytes per element against 2 for bf16.

A non-finite value in a parameter makes its block's scale non-finite; every rank sees the
same gathered scales, so every rank raises the same :class:`NonFiniteWeightError` naming the
parameter, after the gather (no rank is left waiting in a collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.dbuffer import observer
from vescale_plugins.dbuffer.collectives import PointToPointWork, all_gather_into
from vescale_plugins.dbuffer.observer import COMM_BUFFER_REGION
from vescale_plugins.dbuffer.quant_kernels import (
    Segments,
    dequantize_segments,
    dequantize_sum_segments,
    quantize_segments,
)
from vescale_plugins.planner.bounds import round_up

__all__ = [
    "BlockTable",
    "NonFiniteWeightError",
    "PendingDequantize",
    "QuantizedGradReduce",
    "QuantizedWeightGather",
]

_ALIGN_BYTES = 16
_SCALE_BYTES = 4  # fp32 scales


class NonFiniteWeightError(ValueError):
    """A parameter held nan or inf at a quantized all-gather (raised on every rank)."""


class BlockTable:
    """The quantization blocks and padding of one DBuffer's global buffer, rank by rank.

    Args:
        params: ``(global offset, numel, block)`` per slot, elements: a slot's blocks are runs
            of ``block`` elements from its offset (the last may be shorter).
        shard_size: elements per rank (``S``); world_size: ranks.

    Each rank's blocks are numbered from 0 in order; ``max_blocks`` is the most any rank
    holds (at least 1), the scale slots every rank's chunk carries.
    """

    def __init__(self, params: Sequence[tuple[int, int, int]], shard_size: int, world_size: int) -> None:
        self.shard_size, self.world_size = shard_size, world_size
        starts: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        owners: list[torch.Tensor] = []
        cursor = 0
        for index, (offset, numel, block) in sorted(enumerate(params), key=lambda item: item[1][0]):
            if numel == 0:
                continue  # its one planned element is padding
            self._add_padding(cursor, offset, starts, lengths, owners)
            first = torch.arange(0, numel, block, dtype=torch.int64)
            starts.append(first + offset)
            lengths.append((numel - first).clamp_(max=block))
            owners.append(torch.full_like(first, index))
            cursor = offset + numel
        self._add_padding(cursor, shard_size * world_size, starts, lengths, owners)
        self.starts, self.lengths, self.owners = torch.cat(starts), torch.cat(lengths), torch.cat(owners)
        ranks = self.starts // shard_size
        if not torch.equal(ranks, (self.starts + self.lengths - 1) // shard_size):
            raise ValueError("a quantization block straddles two ranks: the layout was not planned with quant_block")
        is_block = self.owners >= 0
        per_rank = torch.bincount(ranks[is_block], minlength=world_size)
        self.max_blocks = max(1, int(per_rank.max()))
        ordinal = torch.cumsum(is_block, 0) - is_block.long()  # blocks before each segment
        ordinal -= (torch.cumsum(per_rank, 0) - per_rank)[ranks]  # ... within its rank
        self.local_slots = torch.where(is_block, ordinal, -1)
        self.global_slots = torch.where(is_block, ranks * self.max_blocks + ordinal, -1)
        bounds = torch.arange(world_size + 1, dtype=torch.int64) * shard_size
        self.rank_first = torch.searchsorted(self.starts, bounds).tolist()

    def _add_padding(
        self,
        start: int,
        stop: int,
        starts: list[torch.Tensor],
        lengths: list[torch.Tensor],
        owners: list[torch.Tensor],
    ) -> None:
        """Padding ``[start, stop)`` as segments of their own, cut at rank boundaries."""
        edges = [start, *range((start // self.shard_size + 1) * self.shard_size, stop, self.shard_size), stop]
        pieces = [(a, b - a) for a, b in zip(edges, edges[1:]) if b > a]
        if pieces:
            starts.append(torch.tensor([a for a, _ in pieces], dtype=torch.int64))
            lengths.append(torch.tensor([n for _, n in pieces], dtype=torch.int64))
            owners.append(torch.full((len(pieces),), -1, dtype=torch.int64))

    def local(self, rank: int) -> Segments:
        """Rank ``rank``'s segments, starts relative to its shard, scale slots in its chunk."""
        first, last = self.rank_first[rank], self.rank_first[rank + 1]
        return Segments.of(
            self.starts[first:last] - rank * self.shard_size,
            self.lengths[first:last],
            self.local_slots[first:last],
            self.shard_size,
        )

    def whole(self) -> Segments:
        """Every rank's segments over the global buffer, scale slots in the gathered scales."""
        return Segments.of(self.starts, self.lengths, self.global_slots, self.shard_size)

    def owner_of_scale(self, slot: int) -> tuple[int, int]:
        """``(parameter index, rank)`` of global scale slot ``slot``."""
        segment = int((self.global_slots == slot).nonzero()[0])
        return int(self.owners[segment]), slot // self.max_blocks


class QuantizedWeightGather:
    """One DBuffer's int8 all-gather (module docstring): the block table, cut once, and the
    packed chunk's geometry. ``names``: the parameters' names, for errors."""

    def __init__(self, table: BlockTable, rank: int, names: Sequence[str], unit: str, device: torch.device) -> None:
        self.table, self.names, self.unit = table, tuple(names), unit
        shard = table.shard_size
        self.scales_at = round_up(shard, _ALIGN_BYTES)  # byte offset of the scales in a chunk
        self.chunk_bytes = round_up(self.scales_at + _SCALE_BYTES * table.max_blocks, _ALIGN_BYTES)
        self._local = table.local(rank).to(device)
        self._whole = table.whole().to(device)

    @property
    def gathered_bytes(self) -> int:
        """Bytes the all-gather writes (every rank's chunk): what the run record counts."""
        return self.table.world_size * self.chunk_bytes

    def issue(
        self, unsharded: torch.Tensor, sharded: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> PendingDequantize:
        """Quantize ``sharded`` (this rank's flat shard), start the all-gather and return what
        finishes it; the dequantization into ``unsharded`` is issued now if the gather is
        (synchronous, or enqueued on the caller's stream), else at ``wait()``."""
        table = self.table
        with observer.scope(COMM_BUFFER_REGION):
            local = torch.empty(self.chunk_bytes, dtype=torch.uint8, device=unsharded.device)
            gathered = torch.empty(self.gathered_bytes, dtype=torch.uint8, device=unsharded.device)
        scales = local[self.scales_at : self.scales_at + _SCALE_BYTES * table.max_blocks].view(torch.float32)
        local[self.scales_at + scales.numel() * _SCALE_BYTES :].zero_()
        quantize_segments(sharded.to(unsharded.device), self._local, local[: table.shard_size].view(torch.int8), scales)
        local[table.shard_size : self.scales_at].zero_()
        work = all_gather_into(gathered, local, group, async_op=async_op)
        pending = PendingDequantize(self, gathered, unsharded, work)
        if work is None:
            pending.dequantize()
        return pending

    def dequantize(self, gathered: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        """Write the gathered chunks' parameters into ``unsharded``; returns the scales (flat)."""
        table = self.table
        by_rank = gathered.view(table.world_size, self.chunk_bytes)
        scales = by_rank[:, self.scales_at : self.scales_at + _SCALE_BYTES * table.max_blocks]
        scales = scales.contiguous().view(torch.float32).view(-1)
        dequantize_segments(
            gathered.view(torch.int8),
            self.chunk_bytes,
            table.shard_size,
            scales,
            self._whole,
            unsharded,
        )
        return scales

    def refuse_non_finite(self, scales: torch.Tensor) -> None:
        """Raise :class:`NonFiniteWeightError` naming the first parameter (by position) whose
        block's scale is not finite."""
        bad = (~torch.isfinite(scales)).nonzero()
        if not bad.numel():
            return
        index, rank = min(self.table.owner_of_scale(int(slot)) for slot in bad[:, 0].tolist())
        raise NonFiniteWeightError(
            f"parameter {self.names[index]!r} of unit {self.unit!r} holds nan or inf (in its shard on rank {rank}) "
            "at an int8-quantized all-gather (comm_policy=QuantizedComm(weights='int8')), which cannot carry them; "
            "find what wrote it (a diverged step, a bad checkpoint), or gather this unit exactly (comm_policy=None)"
        )


class PendingDequantize:
    """An issued quantized all-gather: ``wait()`` completes it, dequantizes (if not done at
    issue) and refuses non-finite parameters (a host read of one flag)."""

    def __init__(
        self, gather: QuantizedWeightGather, gathered: torch.Tensor, unsharded: torch.Tensor, work: Any
    ) -> None:
        self._gather, self._gathered, self._unsharded, self._work = gather, gathered, unsharded, work
        self._scales: torch.Tensor | None = None
        self._ready: Any = None

    def dequantize(self) -> None:
        self._scales = self._gather.dequantize(self._gathered, self._unsharded)
        self._gathered = None  # type: ignore[assignment]  # freed once dequantized
        if self._scales.is_cuda:  # on the gather's stream: the host read below waits for it alone
            self._ready = torch.cuda.Event()
            self._ready.record()

    def wait(self) -> bool:
        work, self._work = self._work, None
        if work is not None:
            work.wait()
            self.dequantize()
        if self._scales is None:
            return True
        scales, self._scales = self._scales, None
        if self._ready is not None:
            self._ready.synchronize()
        if not bool(torch.isfinite(scales).all()):
            self._gather.refuse_non_finite(scales)
        return True


class QuantizedGradReduce:
    """One DBuffer's int8 gradient reduction (ZeRO++'s qgZ over the planner's blocks): every
    rank quantizes the whole unsharded gradient buffer in one pass, one packed message per
    destination rank (that rank's shard's blocks: codes, scales, then the presence flags in
    fp32, exact); an all-to-all hands each rank every rank's message for its shard; it
    dequantizes and sums them in fp32 (senders in rank order) and scales the sum as the
    exact reduce-scatter would. ``grad_chunk``: elements per rank chunk of the unsharded
    gradient buffer (its shard, then the flags and their alignment)."""

    def __init__(self, table: BlockTable, rank: int, grad_chunk: int, device: torch.device) -> None:
        self.table, self.grad_chunk = table, grad_chunk
        shard, blocks = table.shard_size, table.max_blocks
        self.flags = grad_chunk - shard
        self.scales_at = round_up(shard, _ALIGN_BYTES)
        self.flags_at = round_up(self.scales_at + _SCALE_BYTES * blocks, _ALIGN_BYTES)
        self.chunk_bytes = round_up(self.flags_at + _SCALE_BYTES * self.flags, _ALIGN_BYTES)
        self._local = table.local(rank).to(device)
        self._whole = table.whole().to(device)

    @property
    def sent_bytes(self) -> int:
        """Bytes each rank sends (every destination's message, its own included)."""
        return self.table.world_size * self.chunk_bytes

    def _fields(self, messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales ``(ranks, blocks)`` and flags ``(ranks, flags)`` of packed messages, fp32 views."""
        by_rank = messages.view(self.table.world_size, self.chunk_bytes)
        blocks = self.table.max_blocks
        scales = by_rank[:, self.scales_at : self.scales_at + _SCALE_BYTES * blocks].view(torch.float32)
        flags = by_rank[:, self.flags_at : self.flags_at + _SCALE_BYTES * self.flags].view(torch.float32)
        return scales, flags

    def issue(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        group: dist.ProcessGroup,
        average: bool,
        premul_divide: float | None,
        async_op: bool,
    ) -> PointToPointWork | None:
        """Reduce ``full`` (the unsharded gradient buffer, ranks' chunks of ``grad_chunk``)
        into ``out`` (this rank's chunk, the reduce dtype). ``average`` and ``premul_divide``
        as :func:`.collectives.reduce_scatter_into`'s, applied to the fp32 sum."""
        table, world = self.table, self.table.world_size
        with observer.scope(COMM_BUFFER_REGION):
            send = torch.zeros(self.sent_bytes, dtype=torch.uint8, device=full.device)
            received = torch.empty(self.sent_bytes, dtype=torch.uint8, device=full.device)
        scales = torch.empty(world * table.max_blocks, dtype=torch.float32, device=full.device)
        quantize_segments(
            full,
            self._whole,
            send.view(torch.int8),
            scales,
            shard=table.shard_size,
            source_chunk=self.grad_chunk,
            codes_chunk=self.chunk_bytes,
        )
        sent_scales, sent_flags = self._fields(send)
        sent_scales.copy_(scales.view(world, table.max_blocks))
        sent_flags.copy_(full.view(world, self.grad_chunk)[:, table.shard_size :])
        work = dist.all_to_all_single(received, send, group=group, async_op=True)
        pending = PointToPointWork(
            [work], lambda: self._sum(received, out, average, premul_divide), keep_alive=(send, received)
        )
        if not async_op:
            pending.wait()
            return None
        return pending

    def _sum(self, received: torch.Tensor, out: torch.Tensor, average: bool, premul_divide: float | None) -> None:
        table, shard = self.table, self.table.shard_size
        scales, flags = self._fields(received)
        total = torch.empty(shard, dtype=torch.float32, device=out.device)
        dequantize_sum_segments(
            received.view(torch.int8), self.chunk_bytes, scales.reshape(-1), table.max_blocks, self._local, total
        )
        divisor = (table.world_size if average else 1) * (premul_divide or 1)
        out[:shard].copy_(total.div_(divisor) if divisor != 1 else total)
        out[shard:].copy_(flags.sum(0).div_(divisor))

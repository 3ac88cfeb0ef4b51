"""Persistent all-gather input buffers for FSDP2's tensor-subclass all-gather extensions.

An extension (``fsdp_pre_all_gather``, e.g. float8 or MXFP8 all-gather) turns a parameter's
local shard into one or more all-gather inputs: its data in 8 bits, per-row or per-block
scales. Each input has the shard's rows as its dim 0 and a fixed number of elements per row
(the parameter's own for float8 data, 1/32 of it for MXFP8 scales). The inputs of one kind
(one dtype, one ratio of elements per row to the parameter's) live in one :class:`InputBuffer`:
a persistent sharded buffer that the extension's output is copied into (one copy, as the
mixed-precision cast) and an unsharded one that the all-gather writes in place.

Its layout follows the DBuffer's: rank r holds the same rows of each parameter as in the
DBuffer, and each parameter is one contiguous interval of the gathered buffer, so the gathered
inputs are views of it (no copy out). Where the DBuffer puts a parameter across ranks, its
pieces here end the first rank's shard, fill the ranks between and start the last one's; the
parameters inside one rank are packed between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vescale_plugins.dbuffer import observer
from vescale_plugins.dbuffer.buffer import DBuffer
from vescale_plugins.dbuffer.collectives import all_gather_into
from vescale_plugins.dbuffer.faults import BROKEN
from vescale_plugins.dbuffer.handles import GatherHandle
from vescale_plugins.dbuffer.observer import ALL_GATHER_REGION
from vescale_plugins.dbuffer.planning import row_numel
from vescale_plugins.dbuffer.storage import ResizableStorage

__all__ = ["InputBuffer", "InputPiece"]


@dataclass(frozen=True)
class InputPiece:
    """Where one parameter's input lives (elements): this rank's part in the sharded buffer,
    and the whole input in the gathered buffer."""

    local_offset: int
    local_length: int
    global_offset: int
    numel: int


class InputBuffer:
    """One kind of all-gather input of some of a DBuffer's parameters.

    Args:
        dbuffer: the DBuffer whose layout (which rows each rank holds) the inputs follow.
        members: ``(slot, elements per row)`` of each parameter with an input of this kind.
        dtype: the inputs' dtype.
    """

    def __init__(self, dbuffer: DBuffer, members: Sequence[tuple[int, int]], dtype: torch.dtype) -> None:
        self.dbuffer, self.dtype = dbuffer, dtype
        world_size, layout = dbuffer.world_size, dbuffer.layout
        parts = {
            slot: [length // row_numel(dbuffer.slots[slot].shape) * per_row for _, length in layout.shard_ranges(slot)]
            for slot, per_row in members
        }
        self.shard_size = max(1, max(sum(p[r] for p in parts.values()) for r in range(world_size)))
        shard = self.shard_size
        filled = [0] * world_size  # each rank's shard is packed from the front
        self.pieces: dict[int, InputPiece] = {}
        # In the DBuffer's order, a rank's piece of a parameter that starts on an earlier rank
        # comes first and one that goes on to a later rank last.
        for slot in sorted(parts, key=lambda s: layout.offsets[s]):
            ranks = [r for r, n in enumerate(parts[slot]) if n]
            first, last = (ranks[0], ranks[-1]) if ranks else (0, 0)
            starts: dict[int, int] = {}
            for r in range(first, last + 1):
                n = parts[slot][r]
                if first < r < last and n != shard:
                    raise ValueError(
                        f"slot {slot}'s inputs do not fill rank {r}'s shard ({n} of {shard} elements): "
                        "inputs of one buffer must have one ratio of elements per row to their parameter's"
                    )
                starts[r] = shard - n if r == first < last else filled[r]
                filled[r] = starts[r] + n
            self.pieces[slot] = InputPiece(
                starts.get(dbuffer.rank, 0),
                parts[slot][dbuffer.rank],
                first * shard + starts.get(first, 0),
                sum(parts[slot]),
            )
        self.sharded = torch.empty(shard, dtype=dtype, device=dbuffer.device)
        self._unsharded = ResizableStorage(world_size * shard, dtype, dbuffer.device, "unsharded_params")

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded.allocated

    def sharded_piece(self, slot: int) -> torch.Tensor:
        """This rank's part of ``slot``'s input: where the extension's output is copied in."""
        piece = self.pieces[slot]
        return self.sharded[piece.local_offset : piece.local_offset + piece.local_length]

    def gathered(self, slot: int) -> torch.Tensor:
        """``slot``'s whole input, a flat view of the gathered buffer (valid while allocated)."""
        piece = self.pieces[slot]
        return self._unsharded.tensor[piece.global_offset : piece.global_offset + piece.numel]

    def all_gather(self, async_op: bool = False) -> GatherHandle:
        """Gather the sharded inputs into the unsharded buffer, in place, as bytes (any dtype
        on any backend: gloo has no float8)."""
        dbuffer, streams = self.dbuffer, self.dbuffer.streams
        site = dbuffer.gather_site(dbuffer.group)
        if dbuffer.group in BROKEN:
            site.check_usable()
        with observer.region(ALL_GATHER_REGION), streams.issue_on(streams.all_gather):
            unsharded = self._unsharded.allocate()
            version = unsharded._version
            watcher = observer.current()
            token = (
                watcher.collective_issued("all_gather", dbuffer.label, self._unsharded.nbytes, self.dtype)
                if watcher is not None
                else None
            )
            try:
                work = all_gather_into(
                    unsharded.view(torch.uint8),
                    self.sharded.view(torch.uint8),
                    dbuffer.group,
                    async_op=async_op and not streams.enabled,
                )
            except RuntimeError as err:
                site.translate(err)
                raise
            done = streams.record(streams.all_gather)
            handle = GatherHandle(unsharded, version, work, token, streams, done, site)
        if not async_op:
            handle.wait()
        return handle

    def release(self) -> None:
        """Free the gathered inputs' memory (their views stay, without storage)."""
        self._unsharded.release()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of the gathered buffer (its memory is this buffer's)."""
        return tensor.untyped_storage().data_ptr() == self._unsharded.tensor.untyped_storage().data_ptr()

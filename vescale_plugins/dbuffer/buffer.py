"""DBuffer: one unit's persistent flat buffers, laid out by the planner.

For one dtype group of one FSDP unit, the planner gives every parameter a contiguous interval
of a global buffer of ``world_size * shard_size`` elements with no block cut by a rank
boundary. Rank r keeps ``[r * S, (r + 1) * S)`` as its *sharded buffer*; each parameter's
shard is a fixed view into it. The all-gather of the sharded buffer writes the global layout
straight into the *unsharded buffer*, whose slices are the full parameters, and the
reduce-scatter of the *unsharded gradient buffer* (same layout) writes straight into the
*sharded gradient buffer*, whose slices are the gradients' shards. No copy-in, no copy-out,
no interleaving, no per-parameter padding. (``inplace_collectives``: NCCL's tensor
collectives, or point-to-point messages on gloo, whose own collectives stage full copies.)

Unsharded buffers keep one tensor object for the whole run and only grow or shrink their
storage, so the views cut from them once stay valid (FSDP2 does the same for its params).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from vescale_plugins.observe import record as run_record
from vescale_plugins.dbuffer.streams import CommStreams, comm_streams_for
from vescale_plugins.planner import Layout, plan_layout
from vescale_plugins.ragged.layout import ragged_layout
from vescale_plugins.dbuffer.storage_pool import StoragePool
from vescale_plugins.dbuffer.collectives import all_gather_into as _all_gather, reduce_scatter_into as _reduce_scatter

__all__ = ["DBuffer", "planner_inputs", "sharded_padding_of", "BufferSlot", "GatherHandle", "ReduceScatterHandle", "ALL_GATHER_REGION", "REDUCE_SCATTER_REGION", "GRADIENT_BUFFER_REGION", "GRADIENT_RELEASE_REGION", "COMM_BUFFER_REGION"]

# Profiler record-function names around the library's collective paths (tests count the
# copies inside them; the run record times them).
ALL_GATHER_REGION = "vescale::all_gather"
REDUCE_SCATTER_REGION = "vescale::reduce_scatter"
# Marked only while a run record is open, so its memory split can tell the buffers apart.
GRADIENT_BUFFER_REGION = "vescale::gradient_buffer"
# Where autograd's gradients are copied into the buffer and freed (the record counts them as
# unsharded gradients by where they die: they are born in whichever op computed them).
GRADIENT_RELEASE_REGION = "vescale::gradient_release"
COMM_BUFFER_REGION = "vescale::comm_buffer"

# Collectives and vectorised kernels like 16-byte aligned buffers; offsets are in elements.
_ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class BufferSlot:
    """Where one parameter lives: its global interval and this rank's part of it (elements)."""

    global_offset: int
    numel: int
    shape: torch.Size
    local_offset: int
    local_length: int
    local_units: tuple[int, ...]
    block_rows: int


def planner_inputs(shapes: Sequence[torch.Size], block_rows: Sequence[int], dtype: torch.dtype) -> tuple[list[int], list[int], int]:
    """What the planner is asked for these parameters: numels, block sizes and alignment, in
    elements (``_ALIGNMENT_BYTES`` of ``dtype``). A zero-size parameter (FSDP2 accepts them)
    is planned as one element that holds nothing."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numels = [max(1, math.prod(s)) for s in shapes]
    blocks = [rows * _row_numel(s) if len(s) and math.prod(s) else 1 for s, rows in zip(shapes, block_rows)]
    return numels, blocks, max(1, _ALIGNMENT_BYTES // itemsize)


def _row_numel(shape: torch.Size) -> int:
    return math.prod(shape[1:]) if len(shape) > 0 else 1


def _local_shape(shape: torch.Size, length: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return tuple(shape) if length else (0,)
    return (length // _row_numel(shape), *shape[1:])


def _gaps(intervals: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parts of ``[0, size)`` no interval covers (the layout's padding)."""
    gaps, covered = [], 0
    for start, end in sorted(intervals):
        if start > covered:
            gaps.append((covered, start))
        covered = max(covered, end)
    if covered < size:
        gaps.append((covered, size))
    return gaps


def _fp16_pre_divide_factor(factor: float) -> float:
    """The power of two FSDP2 divides fp16 gradients by before reducing (about sqrt(factor))."""
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre)


def set_version_counter(tensor: torch.Tensor, version: int) -> None:
    """Reset ``tensor``'s autograd version counter (shared with all its views) to ``version``.

    The all-gather refills the storage that the unsharded parameters (saved for backward)
    alias, with the same values, so autograd must not see it as a modification. gloo's
    asynchronous all-gather writes from its own thread, after the call returns, so the
    version is restored when the collective is waited on. FSDP2 uses the same private API
    (through ``_unsafe_preserve_version_counter``) for its copy-out.
    """
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))




class _StorageToggle:
    """A flat tensor whose storage can be released and re-grown in place (views survive).

    With a ``pool`` (CPU), released memory goes to the pool and an allocation takes a pooled
    block of its ``kind`` and size when there is one (see ``storage_pool``).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, kind: str) -> None:
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = numel * self.tensor.element_size()
        self.kind = kind
        self.pool: StoragePool | None = None
        self.release()

    @property
    def allocated(self) -> bool:
        return self.tensor.untyped_storage().size() > 0

    def allocate(self) -> torch.Tensor:
        storage = self.tensor.untyped_storage()
        if storage.size() == 0 and not (self.pool is not None and self.nbytes and self.pool.take(self.kind, storage, self.nbytes)):
            storage.resize_(self.nbytes)
        return self.tensor

    def release(self) -> None:
        if self.tensor.device.type == "meta":
            return
        storage = self.tensor.untyped_storage()
        if self.pool is not None and storage.size() > 0:
            self.pool.put(self.kind, storage)
        else:
            storage.resize_(0)


def _record_scope(name: str) -> Any:
    """A profiler scope while a run record is open (its memory split reads them), else nothing."""
    return torch.profiler.record_function(name) if run_record.ACTIVE is not None else contextlib.nullcontext()


def _wait_collective(work: dist.Work) -> None:
    """Complete an issued collective (gloo finishes some of its work here, on this thread)."""
    work.wait()


class GatherHandle:
    """An issued all-gather: ``wait()`` completes it and hides the refill from autograd."""

    def __init__(self, unsharded: torch.Tensor, version: int, work: dist.Work | None, event: Any = None, streams: CommStreams | None = None, done: Any = None) -> None:
        self._unsharded, self._version, self._work, self._event = unsharded, version, work, event
        self._streams, self._done = streams, done
        self.after_wait: Callable[[], None] | None = None

    def wait(self) -> None:
        record = run_record.ACTIVE
        # A synchronous collective (no work to wait on) kept the caller waiting throughout.
        wait_started = (record.now() if self._work is not None else self._event.start_s) if self._event is not None and record is not None else 0.0
        if self._work is not None:
            _wait_collective(self._work)
            self._work = None
        if self._done is not None:
            self._streams.wait(self._done)
            self._done = None
        set_version_counter(self._unsharded, self._version)
        if self._event is not None and record is not None:
            record.collective_done(self._event, wait_started)
            self._event = None
        if self.after_wait is not None:
            after_wait, self.after_wait = self.after_wait, None
            after_wait()


class ReduceScatterHandle:
    """An issued reduce-scatter: ``wait()`` completes it, scales, and frees the full gradients."""

    def __init__(self, dbuffer: "DBuffer", work: dist.Work | None, full: torch.Tensor, out: torch.Tensor, sharded_grad: torch.Tensor, divide_factor: float, accumulate: bool, in_place: bool, event: Any, temp_bytes: int, done_event: Any = None) -> None:
        self._dbuffer, self._work, self._full, self._out, self._sharded_grad = dbuffer, work, full, out, sharded_grad
        self._divide_factor, self._accumulate, self._in_place = divide_factor, accumulate, in_place
        self._event, self._temp_bytes, self._done_event = event, temp_bytes, done_event
        self.done = False
        # Run once the sharded gradients are final (post-accumulate-grad hooks).
        self.after_wait: Callable[[], None] | None = None
        self.replicate_group: dist.ProcessGroup | None = None  # HSDP: all-reduce across replicas
        self.partial = False  # HSDP without all-reduce: keep the shard group's sum back

    def wait(self) -> None:
        if self.done:
            return
        record = run_record.ACTIVE
        wait_started = (record.now() if self._work is not None else self._event.start_s) if self._event is not None and record is not None else 0.0
        with torch.profiler.record_function(REDUCE_SCATTER_REGION):
            if self._work is not None:
                _wait_collective(self._work)
            # The compute stream waits before it reads the result or frees the input.
            self._dbuffer.streams.wait(self._done_event)
            if self._event is not None and record is not None:
                record.collective_done(self._event, wait_started)
            out, sharded_grad = self._out, self._sharded_grad
            if self.partial:
                self._dbuffer.keep_partial(out)
            else:
                self._finish_gradients(out, sharded_grad)
            if record is not None:
                record.buffer_freed("comm_buffers", self._temp_bytes)
        # Keep the sharded gradient buffer: it is held weakly by the DBuffer, so this handle is
        # what keeps it alive until the caller has made the gradients' views of it.
        self._full = self._out = None
        self._dbuffer.release_unsharded_grad()
        self.done = True
        if self.after_wait is not None:
            after_wait, self.after_wait = self.after_wait, None
            after_wait()

    def _finish_gradients(self, out: torch.Tensor, sharded_grad: torch.Tensor) -> None:
        """All-reduce across replicas (HSDP), divide once, and land in the sharded gradients."""
        if self.replicate_group is not None:
            self._dbuffer.add_partial(out)
            dist.all_reduce(out, group=self.replicate_group)
        if self._divide_factor != 1:
            out.div_(self._divide_factor)
        if self._accumulate:
            shard_size = self._dbuffer.shard_size
            sharded_grad[:shard_size].add_(out[:shard_size])
            sharded_grad[shard_size:].copy_(out[shard_size:])  # this reduce's presence flags
        elif not self._in_place:
            sharded_grad.copy_(out)


# Sharded buffers by storage address, so a group-level optimizer can tell the padding between
# parameters from data it must not touch (see ``sharded_padding_of``).
_SHARDED_OWNERS: "weakref.WeakValueDictionary[int, DBuffer]" = weakref.WeakValueDictionary()


def sharded_padding_of(tensor: torch.Tensor) -> list[tuple[int, int]] | None:
    """Padding of the sharded DBuffer whose storage ``tensor`` views, as ``(start, end)``
    element offsets into that storage; ``None`` if the storage is no DBuffer's."""
    owner = _SHARDED_OWNERS.get(tensor.untyped_storage().data_ptr())
    if owner is None or owner.sharded.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        return None
    low, high = owner.rank * owner.shard_size, (owner.rank + 1) * owner.shard_size
    base = owner.sharded.storage_offset()
    return [(base + max(a, low) - low, base + min(b, high) - low) for a, b in owner._padding if max(a, low) < min(b, high)]


class DBuffer:
    """The flat buffers of one unit's parameters that share a dtype.

    Args:
        shapes: parameter shapes, in the unit's order.
        block_rows: rows of dim 0 that must stay on one rank, per parameter, counted from
            row 0 (need not divide the rows: the last block is then shorter).
        dtype, device: of the sharded (and full-precision) parameters.
        group: the process group that shards them.
        param_dtype: dtype of the unsharded parameters (mixed precision), default ``dtype``.
        reduce_dtype: dtype of the reduce-scatter, default ``param_dtype``.
        layout: reuse this plan instead of planning (rebuilding in another device or dtype).
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        block_rows: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.group = group
        self.label = "unit"  # the unit's module name, set when the root initialises (run record)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dtype, self.device = dtype, torch.device(device)
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        numels, blocks, alignment = planner_inputs(shapes, block_rows, dtype)
        # A given layout is kept (a rebuild after module.to() must not move any shard).
        self.layout: Layout = layout or plan_layout(numels, blocks, self.world_size, alignment=alignment)
        self.shard_size = self.layout.shard_size
        self.slots = tuple(self._slot(i, torch.Size(s), rows) for i, (s, rows) in enumerate(zip(shapes, block_rows)))

        self.sharded = torch.zeros(self.shard_size, dtype=dtype, device=self.device)
        self._unsharded = _StorageToggle(self.layout.buffer_size, self.param_dtype, self.device, "unsharded_params")
        # Gradient shards carry one presence flag per parameter after their S elements: every
        # rank writes "I have a local gradient" into each rank's chunk, so the reduce-scatter
        # that already runs tells every rank which parameters got a gradient on some rank
        # (data-dependent routing: experts some ranks' tokens never reached) with no extra
        # collective. ``W * P`` more elements per reduce-scatter.
        self.grad_shard_size = self.shard_size + len(self.slots)
        # In the reduce dtype: copying the gradients in is the mixed-precision cast (FSDP2's
        # chunk-cat casts the same way), so no cast of the whole buffer follows.
        self._unsharded_grad = _StorageToggle(self.world_size * self.grad_shard_size, self.reduce_dtype, self.device, "unsharded_grads")
        self._padding = _gaps([(s.global_offset, s.global_offset + s.numel) for s in self.slots], self.layout.buffer_size)
        _SHARDED_OWNERS[self.sharded.untyped_storage().data_ptr()] = self
        # Held weakly: the gradients' DTensor views keep it alive, so zero_grad(set_to_none=True)
        # frees it before the next forward, as FSDP2's per-parameter gradients are freed.
        self._sharded_grad_ref: Callable[[], torch.Tensor | None] = lambda: None
        # reshard_after_forward=k: this rank's 1/k of the gathered buffer, kept between forward
        # and backward, and the k-rank group that gathers it back.
        self._post_forward: _StorageToggle | None = None
        self._post_forward_group: dist.ProcessGroup | None = None
        self._partial_grad: torch.Tensor | None = None  # HSDP sums awaiting their all-reduce
        self.streams = comm_streams_for(self.device)

    def use_storage_pool(self, pool: StoragePool | None) -> None:
        """Release into / allocate from ``pool`` (the root's; CPU only), or stop (None)."""
        pool = pool if pool is not None and pool.accepts(self.device) else None
        self._unsharded.pool = self._unsharded_grad.pool = pool

    def _slot(self, index: int, shape: torch.Size, rows: int) -> BufferSlot:
        start, length = self.layout.rank_range(index, self.rank)
        numel = math.prod(shape)
        if numel == 0:
            length = 0
        if numel and numel % self.layout.block_sizes[index]:
            # The last block is shorter: RaggedShard needs equal units, so count rows.
            local_units = tuple(n // _row_numel(shape) for _, n in self.layout.shard_ranges(index))
        else:
            local_units = self.layout.local_units(index)
        return BufferSlot(
            global_offset=self.layout.offsets[index],
            numel=numel,
            shape=shape,
            local_offset=start,
            local_length=length,
            local_units=local_units,
            block_rows=rows,
        )

    # -- views ------------------------------------------------------------------------

    def sharded_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s local shard: a view of the sharded buffer."""
        return self._local_view(self.sharded, index)

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """The sharded gradient buffer, while any gradient view of it is alive (else ``None``)."""
        return self._sharded_grad_ref()

    def _sharded_grad_for_reduce(self) -> torch.Tensor:
        buffer = self._sharded_grad_ref()
        if buffer is None:
            buffer = torch.empty(self.grad_shard_size, dtype=self.dtype, device=self.device)
            self._sharded_grad_ref = weakref.ref(buffer)
        return buffer

    def sharded_grad_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient shard: a view of the sharded gradient buffer."""
        return self._local_view(self._sharded_grad_for_reduce(), index)

    def _local_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.slots[index]
        if slot.numel == 0:  # the whole (empty) tensor is one unit: see RaggedShard(dims=())
            return flat[:0].view(ragged_layout(slot.shape, (), slot.local_units).slices[self.rank].local_shape)
        return flat[slot.local_offset : slot.local_offset + slot.local_length].view(_local_shape(slot.shape, slot.local_length))

    def unsharded_view(self, index: int) -> torch.Tensor:
        """Parameter ``index`` in full: a view of the unsharded buffer (valid while allocated)."""
        return self._global_view(self._unsharded.tensor, index)

    def _grad_pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The global interval ``[start, end)`` in the unsharded gradient buffer, cut where
        each rank's chunk ends (its presence flags follow): ``(buffer position, offset in the
        interval, length)`` per piece."""
        pieces, S, flags = [], self.shard_size, len(self.slots)
        position = start
        while position < end:
            rank = position // S if S else 0
            piece_end = min(end, (rank + 1) * S)
            pieces.append((position + rank * flags, position - start, piece_end - position))
            position = piece_end
        return pieces

    def write_unsharded_grad(self, index: int, grad: torch.Tensor | None) -> None:
        """Copy parameter ``index``'s full gradient into the unsharded gradient buffer
        (``None``: zeros), one piece per rank chunk it spans."""
        slot, buffer = self.slots[index], self._unsharded_grad.tensor
        flat = grad.reshape(-1) if grad is not None else None
        for position, offset, length in self._grad_pieces(slot.global_offset, slot.global_offset + slot.numel):
            if flat is None:
                buffer[position : position + length].zero_()
            else:
                buffer[position : position + length].copy_(flat[offset : offset + length])

    def received_gradient(self, sharded_grad: torch.Tensor, indices: Sequence[int]) -> list[bool]:
        """After a reduce-scatter into ``sharded_grad``: whether some rank had a gradient
        for each parameter in ``indices`` (one host read of their flags)."""
        flags = sharded_grad[self.shard_size :]
        return (flags[list(indices)] > 0).tolist()

    def _global_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.slots[index]
        return flat[slot.global_offset : slot.global_offset + slot.numel].view(slot.shape)

    # -- parameters -------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded.allocated

    def all_gather(self, async_op: bool = False) -> "GatherHandle":
        """Gather the sharded buffer into the unsharded one, in place (cast first under MP).

        Returns a handle to ``wait()`` on (already complete unless ``async_op``).
        """
        record = run_record.ACTIVE
        streams = self.streams
        with torch.profiler.record_function(ALL_GATHER_REGION), streams.issue_on(streams.all_gather):
            if record is not None and not self._unsharded.allocated:
                record.buffer_allocated("unsharded_params", self._unsharded.nbytes)
            unsharded = self._unsharded.allocate()
            version = unsharded._version
            group = self._post_forward_group
            if group is not None:
                shard = self._post_forward.tensor  # gathered back within the k ranks only
            else:
                group = self.group
                with _record_scope(COMM_BUFFER_REGION):
                    shard = self.sharded if self.param_dtype == self.dtype else self.sharded.to(self.param_dtype)
            event = record.collective_issued("all_gather", self.label, self._unsharded.nbytes, self.param_dtype) if record is not None else None
            # On a side stream the call returns once enqueued; the handle waits on an event.
            work = _all_gather(unsharded, shard, group, async_op=async_op and not streams.enabled)
            handle = GatherHandle(unsharded, version, work, event, streams, streams.record(streams.all_gather))
            if self._post_forward_group is not None:
                self._post_forward_group = None
                handle.after_wait = self._release_post_forward
        if not async_op:
            handle.wait()
        return handle

    def release_unsharded(self) -> None:
        """Free the unsharded parameters' memory (their views stay, without storage), and
        any post-forward chunk."""
        self._release_full()
        self._post_forward_group = None
        self._release_post_forward()

    def _release_full(self) -> None:
        record = run_record.ACTIVE
        if record is not None and self._unsharded.allocated:
            record.buffer_freed("unsharded_params", self._unsharded.nbytes)
        self._unsharded.release()

    def reshard_to_group(self, group: dist.ProcessGroup) -> None:
        """(``reshard_after_forward=k``) Keep only this rank's ``1/k`` of the gathered buffer,
        ``k`` the size of ``group`` (consecutive ranks of the shard group), and free the rest.

        The kept chunk is ``W/k`` consecutive shards of the planner's layout, so its rank
        boundaries are some of the W-rank layout's: no block is cut, and the gather within
        ``group`` writes the unsharded buffer in place, as the full gather does.
        """
        k, index = dist.get_world_size(group), dist.get_rank(group)
        full = self._unsharded.tensor
        chunk = full.numel() // k
        if self._post_forward is None:
            self._post_forward = _StorageToggle(chunk, self.param_dtype, self.device, "post_forward_params")
        record = run_record.ACTIVE
        if record is not None and not self._post_forward.allocated:
            record.buffer_allocated("unsharded_params", self._post_forward.nbytes)
        kept = self._post_forward.allocate()
        kept.copy_(full[index * chunk : (index + 1) * chunk])
        self._release_full()
        self._post_forward_group = group

    def _release_post_forward(self) -> None:
        if self._post_forward is not None and self._post_forward.allocated:
            record = run_record.ACTIVE
            if record is not None:
                record.buffer_freed("unsharded_params", self._post_forward.nbytes)
            self._post_forward.release()

    # -- gradients --------------------------------------------------------------------

    @property
    def has_unsharded_grad(self) -> bool:
        return self._unsharded_grad.allocated

    def allocate_unsharded_grad(self) -> torch.Tensor:
        """Allocate the unsharded gradient buffer, zeroing only its padding.

        Each parameter's slice is then written whole (its gradient copied in, or zeros if none
        came), so the buffer needs no memset of its own.
        """
        if self._unsharded_grad.allocated:
            return self._unsharded_grad.tensor
        record = run_record.ACTIVE
        if record is not None:
            record.buffer_allocated("unsharded_grads", self._unsharded_grad.nbytes)
        with _record_scope(GRADIENT_BUFFER_REGION):
            buffer = self._unsharded_grad.allocate()
        for start, end in self._padding:
            for position, _, length in self._grad_pieces(start, end):
                buffer[position : position + length].zero_()
        return buffer

    def fill_unsharded_grad(self, grads: dict[int, torch.Tensor | None]) -> None:
        """Allocate the unsharded gradient buffer and copy each slot's gradient into it.

        ``grads`` maps slot index to gradient (None: zeros). It is emptied as the gradients
        are copied, so each is freed right after its copy when ``grads`` held the last
        reference.
        """
        buffer = self.allocate_unsharded_grad()
        present = [0.0] * len(self.slots)
        for index, grad in grads.items():
            present[index] = float(grad is not None)
        # Always marked (once per buffer per step): profiles count this copy by its scope.
        with torch.profiler.record_function(GRADIENT_RELEASE_REGION):
            while grads:
                index, grad = grads.popitem()
                self.write_unsharded_grad(index, grad)
                del grad
            flags = buffer.view(self.world_size, self.grad_shard_size)[:, self.shard_size :]
            flags.copy_(torch.tensor(present, dtype=buffer.dtype).to(buffer.device, non_blocking=True))

    def reduce_scatter(self, divide_factor: float, accumulate: bool, async_op: bool = False, replicate_group: dist.ProcessGroup | None = None, partial: bool = False) -> "ReduceScatterHandle":
        """Reduce-scatter the unsharded gradients into the sharded gradient buffer.

        Sums over the group (gloo has no AVG) and divides by ``divide_factor`` once for the
        whole buffer. With ``accumulate`` the result is added to the existing sharded
        gradients (accumulation across optimizer steps without ``zero_grad``); otherwise it
        lands straight in the sharded gradient buffer. With ``async_op`` the caller must
        ``wait()`` on the handle before reading the gradients.

        HSDP: with ``replicate_group`` the reduced shard is then all-reduced in place across
        the replicas (adding what ``partial`` reduce-scatters kept back) before the division;
        with ``partial`` the shard group's sum is only added to the partial buffer.
        """
        record = run_record.ACTIVE
        streams = self.streams
        with torch.profiler.record_function(REDUCE_SCATTER_REGION), streams.issue_on(streams.reduce_scatter):
            full = self._unsharded_grad.tensor
            in_place = not accumulate and not partial and self.reduce_dtype == self.dtype
            with _record_scope(COMM_BUFFER_REGION):
                temporary_out = None if in_place else torch.empty(self.grad_shard_size, dtype=self.reduce_dtype, device=self.device)
            sharded_grad = self._sharded_grad_for_reduce()
            out = sharded_grad if in_place else temporary_out
            temp_bytes = 0 if in_place else out.numel() * out.element_size()
            event = None
            if record is not None:
                record.buffer_allocated("comm_buffers", temp_bytes)
                event = record.collective_issued("reduce_scatter", self.label, full.numel() * full.element_size(), self.reduce_dtype)
            if self.reduce_dtype == torch.float16 and divide_factor != 1:
                # fp16's range: divide by about sqrt(factor) before the sum and the rest after,
                # as FSDP2 does (bf16 and fp32 are divided once, after).
                pre_factor = _fp16_pre_divide_factor(divide_factor)
                full.div_(pre_factor)
                divide_factor /= pre_factor
            work = _reduce_scatter(out, full, self.group, async_op=async_op and not streams.enabled)
            done_event = streams.record(streams.reduce_scatter)
        handle = ReduceScatterHandle(self, work, full, out, sharded_grad, divide_factor, accumulate, in_place, event, temp_bytes, done_event)
        handle.replicate_group, handle.partial = replicate_group, partial
        if not async_op:
            handle.wait()
        return handle

    def keep_partial(self, reduced: torch.Tensor) -> None:
        """(HSDP, no all-reduce this backward) Add the shard group's sum to the partial buffer."""
        if self._partial_grad is None:
            self._partial_grad = reduced.clone()
        else:
            self._partial_grad.add_(reduced)

    def add_partial(self, reduced: torch.Tensor) -> None:
        """(HSDP, all-reducing backward) Add the sums kept back since the last all-reduce."""
        if self._partial_grad is not None:
            reduced.add_(self._partial_grad)
            self._partial_grad = None

    def release_unsharded_grad(self) -> None:
        record = run_record.ACTIVE
        if record is not None and self._unsharded_grad.allocated:
            record.buffer_freed("unsharded_grads", self._unsharded_grad.nbytes)
        self._unsharded_grad.release()

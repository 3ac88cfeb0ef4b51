"""DBuffer: one group of a unit's parameters in persistent flat buffers, laid out by the planner.

The planner (through :func:`vescale_plugins.dbuffer.planning.plan_buffers`) gives every
parameter a contiguous interval of a global buffer of ``world_size * shard_size`` elements
with no block cut by a rank boundary. Rank r keeps ``[r * S, (r + 1) * S)`` as its *sharded
buffer*; each parameter's shard is a fixed view into it. The all-gather of the sharded buffer
writes the global layout straight into the *unsharded buffer*, whose slices are the full
parameters, and the reduce-scatter of the *unsharded gradient buffer* (same layout) writes
straight into the *sharded gradient buffer*, whose slices are the gradients' shards. No
copy-in, no copy-out, no interleaving, no per-parameter padding.

Unsharded buffers keep one tensor object for the whole run and only grow or shrink their
storage (:class:`.storage.ResizableStorage`), so the views cut from them once stay valid.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._prims_common import make_contiguous_strides_for

from vescale_plugins.dbuffer import observer
from vescale_plugins.dbuffer.collectives import all_gather_into, reduce_scatter_into
from vescale_plugins.dbuffer.faults import BROKEN, CollectiveSite
from vescale_plugins.dbuffer.handles import (
    AfterReduceScatter,
    GatherHandle,
    GradientLanding,
    IssuedReduceScatter,
    ReduceScatterHandle,
    ReduceScatterSpec,
)
from vescale_plugins.dbuffer.observer import (
    ALL_GATHER_REGION,
    COMM_BUFFER_REGION,
    GRADIENT_BUFFER_REGION,
    GRADIENT_RELEASE_REGION,
    REDUCE_SCATTER_REGION,
)
from vescale_plugins.dbuffer.planning import ALIGNMENT_BYTES, is_elementwise, quantization_block, row_numel
from vescale_plugins.dbuffer.quantized import BlockTable, QuantizedGradReduce, QuantizedWeightGather
from vescale_plugins.dbuffer.reduction import GradientReduction
from vescale_plugins.dbuffer.storage import ResizableStorage
from vescale_plugins.dbuffer.streams import comm_streams_for
from vescale_plugins.planner import Layout
from vescale_plugins.planner.bounds import round_up
from vescale_plugins.ragged.layout import ragged_layout
from vescale_plugins.ragged.units import UnitRuns

__all__ = ["BufferSlot", "DBuffer", "slot_units"]


@dataclass(frozen=True)
class BufferSlot:
    """Where one parameter lives: its global interval and this rank's part of it (elements)."""

    global_offset: int
    numel: int
    shape: torch.Size
    local_offset: int
    local_length: int
    local_units: UnitRuns  # units of every rank of the shard group
    block_rows: int | None
    # The dims the ragged cut runs over: (0,) rows of dim 0 (a local shard of whole rows, as
    # FSDP2's Shard(0)); all of them where the planner cut it element-wise (a 1-D local
    # shard); () for a zero-size parameter (one empty unit).
    dims: tuple[int, ...]


class DBuffer:
    """The flat buffers of one group of a unit's parameters (one dtype, one mesh).

    Args:
        shapes: parameter shapes, in the group's order.
        block_rows: rows of dim 0 that must stay on one rank, per parameter, counted from
            row 0 (need not divide the rows: the last block is then shorter); ``None``
            where none were asked for. Whether a parameter is cut in rows or element-wise
            is the layout's (a block shorter than a row: element-wise).
        dtype: of the sharded (and full-precision) parameters.
        device: where they are computed with (gathered, their gradients reduced); the sharded
            parameters and gradients live there too unless ``offload_to_cpu``.
        group: the process group that shards them.
        layout: the planner's layout for these parameters (``planning.plan_buffers``); kept
            as it is when the buffer is rebuilt in another device or dtype.
        param_dtype: dtype of the unsharded parameters (mixed precision), default ``dtype``.
        reduce_dtype: dtype of the reduce-scatter, default ``param_dtype``.
        grad_dtype: dtype of the sharded gradients, default ``dtype`` (a parameter's
            ``grad_dtype`` under torch 2.15's FSDP2).
        offload_to_cpu: keep the sharded parameters and gradients in host memory (FSDP2's
            ``CPUOffloadPolicy``): the all-gather copies its input to ``device`` (with the
            mixed-precision cast) and the reduced shard is copied back.
        pin_memory: (with ``offload_to_cpu``) pinned host memory, so both copies run
            asynchronously on the collectives' streams; only with an accelerator ``device``.
        weight_quant_block: gather the parameters as int8 in blocks of about this many
            elements (:mod:`.quantized`; the layout planned with the same ``quant_block``);
            ``None``: exactly, in ``param_dtype``.
        grad_quant_block: reduce the gradients as int8 blocks through an all-to-all
            (:class:`.quantized.QuantizedGradReduce`), same rules; ``None``: reduce-scatter.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        block_rows: Sequence[int | None],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        layout: Layout,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        offload_to_cpu: bool = False,
        pin_memory: bool = False,
        weight_quant_block: int | None = None,
        grad_quant_block: int | None = None,
    ) -> None:
        self.group = group
        self.label = "unit"  # the unit's module name, set when the root initialises (run record)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dtype, self.device = dtype, torch.device(device)
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.grad_dtype = grad_dtype or dtype
        if layout.world_size != self.world_size or len(layout.numels) != len(shapes):
            raise ValueError(
                f"layout for {len(layout.numels)} tensors over {layout.world_size} ranks given to a DBuffer of {len(shapes)} over {self.world_size}"
            )
        self.layout = layout
        self.shard_size = layout.shard_size
        self.slots = tuple(self._slot(i, torch.Size(s), rows) for i, (s, rows) in enumerate(zip(shapes, block_rows)))

        self.sharded_device = torch.device("cpu") if offload_to_cpu else self.device
        self.pin_memory = offload_to_cpu and pin_memory and self.device.type != "cpu"
        self.sharded = torch.zeros(self.shard_size, dtype=dtype, device=self.sharded_device, pin_memory=self.pin_memory)
        self._unsharded = ResizableStorage(layout.buffer_size, self.param_dtype, self.device, "unsharded_params")
        # Resharding keeps the gathered memory (FSDP2 2.15's set_keep_unsharded_storage), which
        # then holds stale parameters until the next gather.
        self.keep_unsharded_storage = False
        self._kept_after_reshard = False
        # Gradient shards carry one presence flag per parameter after their S elements: every
        # rank writes "I have a local gradient" into each rank's chunk, so the reduce-scatter
        # that already runs tells every rank which parameters got a gradient on some rank
        # (data-dependent routing: experts some ranks' tokens never reached) with no extra
        # collective. ``W * P`` more elements per reduce-scatter.
        # Rounded up so that every rank's chunk starts 16-byte aligned in the reduce dtype.
        self.grad_shard_size = grad_shard_elements(self.shard_size, len(self.slots), self.reduce_dtype.itemsize)
        # In the reduce dtype: copying the gradients in is the mixed-precision cast (FSDP2's
        # chunk-cat casts the same way), so no cast of the whole buffer follows.
        self._unsharded_grad = ResizableStorage(
            self.world_size * self.grad_shard_size, self.reduce_dtype, self.device, "unsharded_grads"
        )
        self._padding = _gaps([(s.global_offset, s.global_offset + s.numel) for s in self.slots], layout.buffer_size)
        self._grad_copy: _GradCopyPlan | None = None  # cut at the first allocation
        # Each slot's gradient shard as (shape, strides, offset) in the sharded gradient buffer,
        # worked out once: every step cuts the views anew from these.
        self._grad_view_geometry = tuple(self._sharded_view_geometry(i) for i in range(len(self.slots)))
        # Held weakly: the gradients' DTensor views keep it alive, so zero_grad(set_to_none=True)
        # frees it before the next forward, as FSDP2's per-parameter gradients are freed.
        self._sharded_grad_ref: Callable[[], torch.Tensor | None] = lambda: None
        # reshard_after_forward=k: this rank's 1/k of the gathered buffer, kept between forward
        # and backward, and the k-rank group that gathers it back.
        self._post_forward: ResizableStorage | None = None
        self._post_forward_group: dist.ProcessGroup | None = None
        self._partial_grad: torch.Tensor | None = None  # HSDP sums awaiting their all-reduce
        self._grad_offload_event: Any = None  # the pinned copy of the reduced shard to host
        self.streams = comm_streams_for(self.device)
        self.weight_quant_block, self.grad_quant_block = weight_quant_block, grad_quant_block
        self.slot_names: tuple[str, ...] = tuple(f"#{i}" for i in range(len(self.slots)))  # for errors
        # Cut at the first quantized collective.
        self._weight_gather: QuantizedWeightGather | None = None
        self._grad_reduce: QuantizedGradReduce | None = None
        self._quant_table: tuple[int, BlockTable] | None = None

    def _slot(self, index: int, shape: torch.Size, rows: int | None) -> BufferSlot:
        start, length = self.layout.rank_range(index, self.rank)
        numel = math.prod(shape)
        if numel == 0:
            length = 0
        # The last block shorter: RaggedShard needs equal units, so count rows.
        block = self.layout.block_sizes[index]
        unit = row_numel(shape) if numel and numel % block else block
        elementwise = is_elementwise(shape, block)
        return BufferSlot(
            global_offset=self.layout.offsets[index],
            numel=numel,
            shape=shape,
            local_offset=start,
            local_length=length,
            local_units=slot_units(self.layout, index, unit),
            block_rows=rows,
            dims=tuple(range(len(shape))) if elementwise else (0,) if len(shape) and numel else (),
        )

    def sharded_padding(self) -> list[tuple[int, int]]:
        """This rank's padding in the sharded buffer, as ``(start, end)`` element offsets into
        it: what lies between parameters there and holds no data (a flat optimizer may step
        across it)."""
        low, high = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        return [(max(a, low) - low, min(b, high) - low) for a, b in self._padding if max(a, low) < min(b, high)]

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
            buffer = torch.empty(
                self.grad_shard_size, dtype=self.grad_dtype, device=self.sharded_device, pin_memory=self.pin_memory
            )
            self._sharded_grad_ref = weakref.ref(buffer)
        return buffer

    def sharded_grad_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient shard: a view of the sharded gradient buffer (one
        ``as_strided``, as FSDP2 cuts its gradient shards)."""
        return self.sharded_grad_views((index,))[0]

    def grad_view_offset(self, index: int) -> int | None:
        """The storage offset :meth:`sharded_grad_view` gives slot ``index``'s view in the live
        sharded gradient buffer (``None`` for an empty slot, or with no buffer alive)."""
        flat = self._sharded_grad_ref()
        geometry = self._grad_view_geometry[index]
        if flat is None or geometry is None:
            return None
        return int(flat.storage_offset()) + geometry[2]

    def sharded_grad_views(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """:meth:`sharded_grad_view` of each of ``indices``, the buffer looked up once."""
        flat = self._sharded_grad_for_reduce()
        base = flat.storage_offset()
        views = []
        for index in indices:
            geometry = self._grad_view_geometry[index]
            if geometry is None:
                views.append(self._local_view(flat, index))
            else:
                views.append(flat.as_strided(geometry[0], geometry[1], base + geometry[2]))
        return views

    def _sharded_view_geometry(self, index: int) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """Slot ``index``'s local shard in a flat sharded buffer: (shape, strides, offset);
        ``None`` for an empty tensor (see :meth:`_local_view`)."""
        slot = self.slots[index]
        if slot.numel == 0:
            return None
        shape = _local_shape(slot)
        return shape, make_contiguous_strides_for(shape), slot.local_offset

    def _local_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.slots[index]
        if slot.numel == 0:  # the whole (empty) tensor is one unit: see RaggedShard(dims=())
            return flat[:0].view(ragged_layout(slot.shape, (), slot.local_units).slices[self.rank].local_shape)
        return flat[slot.local_offset : slot.local_offset + slot.local_length].view(_local_shape(slot))

    def unsharded_view(self, index: int) -> torch.Tensor:
        """Parameter ``index`` in full: a view of the unsharded buffer (valid while allocated)."""
        slot = self.slots[index]
        return self._unsharded.tensor[slot.global_offset : slot.global_offset + slot.numel].view(slot.shape)

    def _grad_pieces(self, start: int, end: int) -> list[torch.Tensor]:
        """The global interval ``[start, end)`` in the unsharded gradient buffer, whose rank
        chunks are ``S`` elements each followed by the presence flags: at most three views of
        it whatever the ranks it spans (the partial chunk it starts in, the whole chunks as
        one ``(k, S)`` view, the partial chunk it ends in). Cut while the buffer is allocated."""
        S = self.shard_size
        if start >= end:
            return []
        chunks = self._unsharded_grad.tensor.view(self.world_size, self.grad_shard_size)[:, :S]
        (first, head), (last, tail) = divmod(start, S), divmod(end, S)
        if first == last:
            return [chunks[first, head:tail]]
        pieces, whole_from = [], first
        if head:
            pieces.append(chunks[first, head:])
            whole_from += 1
        if whole_from < last:
            pieces.append(chunks[whole_from:last])
        if tail:
            pieces.append(chunks[last, :tail])
        return pieces

    def _grad_copy_plan(self) -> _GradCopyPlan:
        """The views of the unsharded gradient buffer each step writes, cut once (its storage
        comes and goes, the views stay): per step only the copies and fills remain."""
        if self._grad_copy is None:
            flags = self._unsharded_grad.tensor.view(self.world_size, self.grad_shard_size)[:, self.shard_size :]
            self._grad_copy = _GradCopyPlan(
                targets=tuple(
                    _GradTargets.of(slot, self._grad_pieces(slot.global_offset, slot.global_offset + slot.numel))
                    for slot in self.slots
                ),
                padding=tuple(piece for start, end in self._padding for piece in self._grad_pieces(start, end)),
                flags=flags,
            )
        return self._grad_copy

    def received_gradient(self, sharded_grad: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        """After a reduce-scatter into ``sharded_grad``: whether some rank had a gradient for
        each parameter in ``indices``, as booleans where the flags are (no host read)."""
        flags = sharded_grad[self.shard_size :]
        return flags[list(indices)] > 0

    # -- parameters -------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded.allocated and not self._kept_after_reshard

    def all_gather(self, async_op: bool = False) -> GatherHandle:
        """Gather the sharded buffer into the unsharded one, in place (cast first under MP,
        copied to the device first under CPU offload: one copy for both).

        Returns a handle to ``wait()`` on (already complete unless ``async_op``).
        """
        streams = self.streams
        group = self._post_forward_group if self._post_forward_group is not None else self.group
        site = self.gather_site(group)
        if group in BROKEN:
            site.check_usable()
        with observer.region(ALL_GATHER_REGION), streams.issue_on(streams.all_gather):
            unsharded = self._unsharded.allocate()
            self._kept_after_reshard = False
            version = unsharded._version
            quantized = self._post_forward_group is None and self.weight_quant_block is not None
            if self._post_forward_group is not None:
                assert self._post_forward is not None  # reshard_to_group set both
                shard = self._post_forward.tensor  # gathered back within the k ranks only
            elif quantized:
                shard = self.sharded  # quantized from the sharded parameters as they are
            else:
                with observer.scope(COMM_BUFFER_REGION):
                    # No copy unless one of them differs; from pinned memory, on this stream.
                    shard = self.sharded.to(self.device, self.param_dtype, non_blocking=self.pin_memory)
            watcher = observer.current() if group.size() > 1 else None  # one rank: a copy, no collective
            token = None
            if watcher is not None:
                # Quantized: the bytes the gather moves, int8 codes and their scales.
                nbytes, dtype = (
                    (self.quantized_weight_gather().gathered_bytes, torch.int8)
                    if quantized
                    else (self._unsharded.nbytes, self.param_dtype)
                )
                token = watcher.collective_issued("all_gather", self.label, nbytes, dtype)
            # On a side stream the call returns once enqueued; the handle waits on an event.
            work: Any
            try:
                if quantized:
                    work = self.quantized_weight_gather().issue(
                        unsharded, shard, group, async_op=async_op and not streams.enabled
                    )
                else:
                    work = all_gather_into(unsharded, shard, group, async_op=async_op and not streams.enabled)
            except RuntimeError as err:
                site.translate(err)
                raise
            if watcher is not None:
                watcher.collective_enqueued(token)
            handle = GatherHandle(unsharded, version, work, token, streams, streams.record(streams.all_gather), site)
            if self._post_forward_group is not None:
                self._post_forward_group = None
                handle.after_wait = self._release_post_forward
        if not async_op:
            handle.wait()
        return handle

    def quantized_weight_gather(self) -> QuantizedWeightGather:
        """The int8 all-gather of this buffer (``weight_quant_block``), its block table cut once."""
        if self._weight_gather is None:
            assert self.weight_quant_block is not None
            table = self._block_table(self.weight_quant_block)
            self._weight_gather = QuantizedWeightGather(table, self.rank, self.slot_names, self.label, self.device)
        return self._weight_gather

    def quantized_grad_reduce(self) -> QuantizedGradReduce:
        """The int8 gradient reduction of this buffer (``grad_quant_block``), cut once."""
        if self._grad_reduce is None:
            assert self.grad_quant_block is not None
            table = self._block_table(self.grad_quant_block)
            self._grad_reduce = QuantizedGradReduce(table, self.rank, self.grad_shard_size, self.device)
        return self._grad_reduce

    def _block_table(self, block: int) -> BlockTable:
        """The quantization blocks of this buffer (one table for the gather and the reduction)."""
        if self._quant_table is None or self._quant_table[0] != block:
            slots = [(s.global_offset, s.numel, quantization_block(s.shape, block)) for s in self.slots]
            self._quant_table = (block, BlockTable(slots, self.shard_size, self.world_size))
        return self._quant_table[1]

    def gather_site(self, group: dist.ProcessGroup) -> CollectiveSite:
        """An all-gather of this buffer over ``group``, issued now, for its error: in backward
        when autograd is running a backward on this thread, else in forward."""
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return CollectiveSite(group, self.label, f"all-gather in {phase}")

    def release_unsharded(self) -> None:
        """Free the unsharded parameters' memory (their views stay, without storage), and
        any post-forward chunk. With ``keep_unsharded_storage`` the memory stays (its
        contents are stale until the next gather)."""
        self._release_unsharded_memory()
        self._post_forward_group = None
        self._release_post_forward()

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
            # Counted as unsharded parameters: it is what stays of them until backward.
            self._post_forward = ResizableStorage(chunk, self.param_dtype, self.device, "unsharded_params")
        kept = self._post_forward.allocate()
        kept.copy_(full[index * chunk : (index + 1) * chunk])
        self._release_unsharded_memory()
        self._post_forward_group = group

    def _release_unsharded_memory(self) -> None:
        if self.keep_unsharded_storage:
            self._kept_after_reshard = self._unsharded.allocated
        else:
            self._unsharded.release()
            self._kept_after_reshard = False

    def _release_post_forward(self) -> None:
        if self._post_forward is not None:
            self._post_forward.release()

    # -- gradients --------------------------------------------------------------------

    @property
    def has_unsharded_grad(self) -> bool:
        return self._unsharded_grad.allocated

    def _allocate_unsharded_grad(self) -> None:
        """Allocate the unsharded gradient buffer, zeroing only its padding.

        Each parameter's slice is then written whole (its gradient copied in, or zeros if none
        came), so the buffer needs no memset of its own.
        """
        if self._unsharded_grad.allocated:
            return
        with observer.scope(GRADIENT_BUFFER_REGION):
            self._unsharded_grad.allocate()
        for piece in self._grad_copy_plan().padding:
            piece.zero_()

    def fill_unsharded_grad(self, grads: dict[int, torch.Tensor | None]) -> None:
        """Allocate the unsharded gradient buffer and copy each slot's gradient into it.

        ``grads`` maps slot index to gradient (None: zeros). It is emptied as the gradients
        are copied, so each is freed right after its copy when ``grads`` held the last
        reference.
        """
        self._allocate_unsharded_grad()
        plan = self._grad_copy_plan()
        present = [False] * len(self.slots)
        for index, grad in grads.items():
            present[index] = grad is not None
        # Marked (once per buffer per step) while a profiler runs: profiles count this copy by
        # its scope.
        with observer.region(GRADIENT_RELEASE_REGION):
            # Every gradient in one ``_foreach_copy_`` (one op per buffer, as FSDP2's one
            # chunk-cat per unit; a multi-tensor kernel where the device has one), plain
            # ``copy_`` per piece for a gradient that is a tensor subclass.
            targets: list[torch.Tensor] = []
            sources: list[torch.Tensor] = []
            while grads:
                index, grad = grads.popitem()
                slot_targets = plan.targets[index]
                views = slot_targets.views
                if type(grad) is torch.Tensor and len(views) == 1 and grad.shape == views[0].shape:
                    targets.append(views[0])  # the common case inline: one view, the gradient's shape
                    sources.append(grad)
                else:
                    slot_targets.collect(grad, targets, sources)
                del grad
            if sources:
                torch._foreach_copy_(targets, sources)
            # Only these lists held the gradients (``grads`` is empty): they are freed here,
            # before the reduce-scatter allocates.
            del targets, sources
            # Filled on the device, one fill per run of equal flags (one in all when every
            # gradient came, the alignment's tail with the last run: reduced, never read):
            # no host-to-device copy.
            start = 0
            for value, run in itertools.groupby(present):
                length = len(list(run))
                end = start + length if start + length < len(present) else plan.flags.shape[1]
                (plan.flags if start == 0 and end == plan.flags.shape[1] else plan.flags[:, start:end]).fill_(
                    float(value)
                )
                start += length

    def reduce_scatter(
        self,
        reduction: GradientReduction,
        accumulate: bool,
        async_op: bool = False,
        after: AfterReduceScatter | None = None,
        partial: bool = False,
    ) -> ReduceScatterHandle:
        """Reduce-scatter the unsharded gradients into the sharded gradient buffer.

        ``reduction`` scales the sum as FSDP2 does (:mod:`.reduction`). With ``accumulate``
        the result is added to the existing sharded gradients (accumulation across optimizer
        steps without ``zero_grad``); otherwise it lands straight in the sharded gradient
        buffer. With ``async_op`` the caller must ``wait()`` on the handle before reading the
        gradients.

        ``after``: what follows the reduce-scatter on the all-reduce stream before the
        post-divide (HSDP's all-reduce across replicas, adding what ``partial``
        reduce-scatters kept back; the all-reduce hook). With ``partial`` the shard group's
        reduction is only added to the partial buffer.
        """
        streams = self.streams
        site = self._reduce_site()
        if self.group in BROKEN:
            site.check_usable()
        with observer.region(REDUCE_SCATTER_REGION), streams.issue_on(streams.reduce_scatter):
            full = self._unsharded_grad.tensor
            in_place = (
                not accumulate
                and not partial
                and self.reduce_dtype == self.grad_dtype
                and self.sharded_device == self.device
            )
            with observer.scope(COMM_BUFFER_REGION):
                temporary_out = (
                    None if in_place else torch.empty(self.grad_shard_size, dtype=self.reduce_dtype, device=self.device)
                )
            sharded_grad = self._sharded_grad_for_reduce()
            out = sharded_grad if temporary_out is None else temporary_out
            temp_bytes = 0 if temporary_out is None else temporary_out.numel() * temporary_out.element_size()
            watcher = observer.current()
            token = None
            quantized = self.grad_quant_block is not None
            if watcher is not None:
                watcher.buffer_allocated("comm_buffers", temp_bytes)
                nbytes, dtype = (
                    (self.quantized_grad_reduce().sent_bytes, torch.int8)
                    if quantized
                    else (full.numel() * full.element_size(), self.reduce_dtype)
                )
                token = (  # one rank: a copy, no collective
                    watcher.collective_issued("reduce_scatter", self.label, nbytes, dtype)
                    if self.group.size() > 1
                    else None
                )
            if reduction.pre_divide is not None and reduction.pre_divide != 1:
                full.div_(reduction.pre_divide)
            issue = self.quantized_grad_reduce().issue if quantized else reduce_scatter_into
            try:
                work = issue(
                    out,
                    full,
                    self.group,
                    average=reduction.reduce_scatter_average,
                    premul_divide=reduction.premul_divide,
                    async_op=async_op and not streams.enabled,
                )
            except RuntimeError as err:
                site.translate(err)
                raise
            if watcher is not None and token is not None:
                watcher.collective_enqueued(token)
            done_event = streams.record(streams.reduce_scatter)
        handle = ReduceScatterHandle(
            self._gradient_landing(),
            ReduceScatterSpec(reduction, accumulate, in_place, after, partial),
            IssuedReduceScatter(work, out, sharded_grad, token, temp_bytes, done_event),
        )
        if not async_op:
            handle.wait()
        return handle

    def _gradient_landing(self) -> GradientLanding:
        """What a reduce-scatter handle does with its output, as callbacks (handles sit below
        the DBuffer). Made per reduce-scatter: held by the DBuffer itself, its bound methods
        would be a reference cycle and keep its buffers alive until a garbage collection."""
        return GradientLanding(
            streams=self.streams,
            shard_size=self.shard_size,
            site=self._reduce_site(),
            release_input=self.release_unsharded_grad,
            land=self.land_reduced,
            keep_partial=self.keep_partial,
            take_partial=self.take_partial,
        )

    def _reduce_site(self) -> CollectiveSite:
        return CollectiveSite(self.group, self.label, "reduce-scatter")

    def land_reduced(self, reduced: torch.Tensor, sharded_grad: torch.Tensor) -> None:
        """Write the reduced shard (on the device) into the sharded gradient buffer; under CPU
        offload into host memory, asynchronously on the reduce-scatter stream from pinned
        memory (:meth:`wait_for_offloaded_grads` before the host reads it)."""
        if not self.pin_memory:
            sharded_grad.copy_(reduced)
            return
        streams = self.streams
        with streams.issue_on(streams.reduce_scatter):
            sharded_grad.copy_(reduced, non_blocking=True)
            self._grad_offload_event = streams.record(streams.reduce_scatter)

    def wait_for_offloaded_grads(self) -> None:
        """Block until the sharded gradients' copy to pinned host memory is done (before the
        optimizer or a gradient hook reads them on the host)."""
        if self._grad_offload_event is not None:
            self._grad_offload_event.synchronize()
            self._grad_offload_event = None

    def keep_partial(self, reduced: torch.Tensor) -> None:
        """(HSDP, no all-reduce this backward) Add the shard group's sum to the partial buffer."""
        if self._partial_grad is None:
            self._partial_grad = reduced.clone()
        else:
            self._partial_grad.add_(reduced)

    def take_partial(self) -> torch.Tensor | None:
        """(HSDP, all-reducing backward) The sums kept back since the last all-reduce, if any
        (the caller adds them to the reduce output and keeps them until that is done)."""
        partial, self._partial_grad = self._partial_grad, None
        return partial

    def release_unsharded_grad(self) -> None:
        self._unsharded_grad.release()


@dataclass(frozen=True)
class _GradTargets:
    """Where one parameter's gradient goes in the unsharded gradient buffer: the buffer's
    views (at most three, see :meth:`DBuffer._grad_pieces`) each shaped as the gradient rows
    it takes, and those rows (rank boundaries fall between rows); for a parameter cut
    element-wise, the views as they are and their elements (the gradient is split flat).
    One split (and one flattening view) when there are several views; the copies are the
    buffer's one ``_foreach_copy_``."""

    views: tuple[torch.Tensor, ...]
    rows: tuple[int, ...]
    flat: bool = False

    @classmethod
    def of(cls, slot: BufferSlot, pieces: list[torch.Tensor]) -> _GradTargets:
        if len(pieces) == 1 and pieces[0].dim() == 1:
            return cls((pieces[0].view(slot.shape),), ())
        if len(slot.dims) > 1:
            return cls(tuple(pieces), tuple(p.numel() for p in pieces), flat=True)
        per_row = row_numel(slot.shape)
        views = tuple(p.view(*p.shape[:-1], p.shape[-1] // per_row, *slot.shape[1:]) for p in pieces)
        return cls(views, tuple(p.numel() // per_row for p in pieces))

    def collect(self, grad: torch.Tensor | None, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        """Add ``grad``'s pieces and the views they are copied to (cast to the buffer's dtype)
        to ``sources`` and ``targets``; zero the views now for ``None``, copy now for a
        tensor subclass (which need not implement ``_foreach_copy_``)."""
        if grad is None:
            for view in self.views:
                view.zero_()
            return
        if len(self.views) > 1:
            parts = (grad.reshape(-1) if self.flat else grad).split(self.rows)
        else:
            parts = (grad,)
        plain = type(grad) is torch.Tensor
        for view, part in zip(self.views, parts):
            part = part if part.shape == view.shape else part.reshape(view.shape)
            if plain:
                targets.append(view)
                sources.append(part)
            else:
                view.copy_(part)


@dataclass(frozen=True)
class _GradCopyPlan:
    """A DBuffer's cut views of its unsharded gradient buffer: each parameter's targets, the
    padding's pieces, and the presence flags with the alignment's tail (``(W, G - S)``)."""

    targets: tuple[_GradTargets, ...]
    padding: tuple[torch.Tensor, ...]
    flags: torch.Tensor


def _local_shape(slot: BufferSlot) -> tuple[int, ...]:
    shape, length = slot.shape, slot.local_length
    if len(shape) == 0:
        return tuple(shape) if length else (0,)
    if len(slot.dims) > 1:  # cut element-wise: a 1-D run of elements
        return (length,)
    return (length // row_numel(shape), *shape[1:])


def slot_units(layout: Layout, index: int, unit: int) -> UnitRuns:
    """Units of ``unit`` elements of tensor ``index`` on every rank (``Layout.local_units``
    when ``unit`` is its block), from its interval alone: zeros, the rank it starts in, whole
    shards, the rank it ends in, zeros; the same few runs at any world size."""
    start, stop = layout.tensor_slice(index)
    S, W = layout.shard_size, layout.world_size
    first, last = start // S, (stop - 1) // S

    def units(elements: int) -> int:
        return -(-elements // unit)

    if first == last:
        runs = [(0, first), (units(stop - start), 1), (0, W - 1 - first)]
    else:
        runs = [
            (0, first),
            (units((first + 1) * S - start), 1),
            (units(S), last - first - 1),
            (units(stop - last * S), 1),
            (0, W - 1 - last),
        ]
    return UnitRuns(runs)


def grad_shard_elements(shard_size: int, num_params: int, itemsize: int) -> int:
    """One rank's chunk of the unsharded gradient buffer, in elements of ``itemsize`` bytes: its
    shard, one presence flag per parameter, rounded up so that every chunk starts aligned."""
    return round_up(shard_size + num_params, max(1, ALIGNMENT_BYTES // itemsize))


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

"""One FSDP unit at run time: its DBuffers, its parameters' two faces, and its hooks.

A unit is what one ``fully_shard`` call manages. Between steps every managed parameter is an
``nn.Parameter(DTensor)`` whose local tensor is a view of a DBuffer's sharded buffer. Around
the unit's forward and backward, the modules see plain unsharded parameters that are views of
the unsharded buffer. Autograd's gradients stay on those parameters through the unit's
backward (and across micro-batches that do not sync, accumulating in place); after the unit
reshards they are copied into the unsharded gradient buffer, which leaves by one
reduce-scatter per DBuffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.utils import _apply_to_tensors
from torch.utils import _pytree as pytree

from ._dtensor_bridge import make_dtensor, set_local_tensor
from .dbuffer import DBuffer, GatherHandle, ReduceScatterHandle
from .placement import RaggedShard
from .storage_pool import StoragePool
from .tensor_parallel import ParallelSpec

__all__ = ["FSDPUnit", "ManagedParam"]


@dataclass
class ManagedParam:
    """One parameter of a unit: where it is registered, its sharded and unsharded faces."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    sharded: nn.Parameter
    buffer_index: int
    slot_index: int
    unsharded: nn.Parameter | None = None
    # The parameter fully_shard replaced, weakly: a module outside the unit still holding it
    # (a tied weight) is a parameter shared across units, which the outer unit must refuse.
    original: Any = None
    # Gradients of micro-batches that did not sync, in the reduce dtype when it differs from
    # the unsharded parameters' (FSDP2 accumulates there, not in bf16 on the parameter).
    accumulated_grad: torch.Tensor | None = None
    # Set when the parameter was already a DTensor (tensor/expert parallel, SPMD mesh): the
    # DBuffer holds its local tensor and the gathered parameter is that DTensor again.
    parallel: ParallelSpec | None = None

    def gathered_grad(self) -> torch.Tensor | None:
        """The gathered parameter's gradient as a local tensor (a TP DTensor's local shard)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None or self.parallel is None:
            return grad
        return self.parallel.local_grad(grad)

    def register(self, param: nn.Parameter) -> None:
        # Bypass nn.Module.__setattr__: the parameter changes identity every forward.
        for module, name in self.owners:
            module._parameters[name] = param


@dataclass
class _IterationState:
    """What one forward/backward pass has done so far to this unit."""

    pending_post_backward: int = 0
    reduced: bool = True
    pre_backward_done: bool = False
    backward_prefetched: bool = False


class FSDPUnit:
    """The runtime of one ``fully_shard`` call (one unit)."""

    def __init__(
        self,
        modules: list[nn.Module],
        params: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter, int, ParallelSpec | None]],
        mesh: DeviceMesh,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.mesh = mesh
        # A 1-D mesh shards over all of it; a 2-D one (HSDP) replicates over dim 0 and shards
        # over dim 1, as FSDP2: DBuffers are laid out for, and gathered in, the shard group.
        shard_dim = mesh.ndim - 1
        self.group = mesh.get_group(shard_dim)
        self.world_size = mesh.size(shard_dim)
        self.rank = mesh.get_local_rank(shard_dim)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.requires_all_reduce = True
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.mp_policy = mp_policy
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float = float(mesh.size())  # every data-parallel rank
        self.is_last_backward = True
        self.forward_prefetch: list[FSDPUnit] | None = None  # None: the next unit (see below)
        self.backward_prefetch: list[FSDPUnit] | None = None
        self.root: FSDPUnit | None = None
        self._iteration = _IterationState()
        self._pending_unshard: list[GatherHandle] = []
        self._modules_run: set[int] = set()
        self._root_units: list[FSDPUnit] = []
        self._forward_order: list[FSDPUnit] = []
        self._previous_forward_order: list[FSDPUnit] = []
        self._reduces_in_flight: list[ReduceScatterHandle] = []
        # (Root) released CPU buffers kept for the next gathers of every unit under it.
        self._storage_pool = StoragePool()
        # (Root) parameters reduced this backward without a local gradient, with the sharded
        # gradient buffer that holds what other ranks sent them (see _attach_remote_gradients).
        self._reduced_without_local_grad: list[tuple[ManagedParam, FSDPUnit, torch.Tensor]] = []
        self.managed = self._build(params)

    # -- construction -----------------------------------------------------------------

    def _build(self, params: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter, int, ParallelSpec | None]]) -> list[ManagedParam]:
        """Plan and allocate one DBuffer per (dtype, requires_grad) group; shard into it."""
        groups: dict[tuple[torch.dtype, bool], list[int]] = {}
        for i, (_, _, param, _, _) in enumerate(params):
            groups.setdefault((param.dtype, param.requires_grad), []).append(i)
        self.dbuffers: list[DBuffer] = []
        managed: list[ManagedParam | None] = [None] * len(params)
        for (dtype, requires_grad), indices in groups.items():
            device = params[indices[0]][2].device
            dbuffer = DBuffer(
                [_local(params[i][2]).shape for i in indices],
                [params[i][3] for i in indices],
                dtype,
                device,
                self.group,
                param_dtype=self.mp_policy.param_dtype if dtype.is_floating_point else None,
                reduce_dtype=self.mp_policy.reduce_dtype if dtype.is_floating_point else None,
            )
            self.dbuffers.append(dbuffer)
            for slot_index, i in enumerate(indices):
                fqn, owners, param, _, parallel = params[i]
                sharded = nn.Parameter(self._shard_into(dbuffer, slot_index, param, parallel), requires_grad=requires_grad)
                managed[i] = ManagedParam(fqn, owners, sharded, len(self.dbuffers) - 1, slot_index, original=weakref.ref(param), parallel=parallel)
        result = [m for m in managed if m is not None]
        for m in result:
            m.register(m.sharded)
            for module, name in m.owners:
                _MANAGED_SLOTS.setdefault(module, {})[name] = (self, m)
        # Which parameters live in which DBuffer is fixed here; per-step code reads it.
        self._members: list[list[ManagedParam]] = [[m for m in result if m.buffer_index == i] for i in range(len(self.dbuffers))]
        return result

    def _placements(self, dbuffer: DBuffer, slot_index: int) -> list[Placement]:
        slot = dbuffer.slots[slot_index]
        # A zero-size parameter is one (empty) unit: dims=() (see DBuffer's zero-size slots).
        ragged = RaggedShard((0,) if len(slot.shape) and slot.numel else (), slot.local_units)
        return [Replicate(), ragged] if self.replicate_group is not None else [ragged]

    def _shard_into(self, dbuffer: DBuffer, slot_index: int, param: torch.Tensor, parallel: ParallelSpec | None) -> torch.Tensor:
        """Copy this rank's part of ``param`` into the sharded buffer once; return the DTensor.

        A tensor-parallel parameter's slot is its local TP tensor; the DTensor lives on the
        (dp, tp) mesh with the ragged cut on the dp dim (see ``tensor_parallel``)."""
        slot = dbuffer.slots[slot_index]
        local = dbuffer.sharded_view(slot_index)
        if param.device.type != "meta":
            with torch.no_grad():
                flat = _local(param).detach().reshape(-1)
                start = self.rank * dbuffer.shard_size + slot.local_offset - slot.global_offset
                local.reshape(-1).copy_(flat[start : start + slot.local_length])
        if parallel is not None:
            (ragged,) = self._placements(dbuffer, slot_index)
            return make_dtensor(local, parallel.sharded_mesh, parallel.sharded_placements(ragged), parallel.shape, parallel.stride)
        return make_dtensor(local, self.mesh, self._placements(dbuffer, slot_index), slot.shape, _contiguous_stride(slot.shape))

    def readopt_sharded_params(self) -> None:
        """After ``to_empty``/``_apply`` replaced local tensors: move them back into DBuffers."""
        for dbuffer_index, dbuffer in enumerate(self.dbuffers):
            members = self._members[dbuffer_index]
            locals_ = [m.sharded._local_tensor for m in members]
            device = locals_[0].device if locals_ else dbuffer.device
            dtype = locals_[0].dtype if locals_ else dbuffer.dtype
            if all(_same_storage(t, dbuffer.sharded_view(m.slot_index)) and t.dtype == dbuffer.dtype for t, m in zip(locals_, members)):
                continue
            if device != dbuffer.device or dtype != dbuffer.dtype or dbuffer.sharded.device.type == "meta":
                label = dbuffer.label
                # module.to(device or dtype) / to_empty: new buffers in the new device and dtype;
                # mixed-precision dtypes follow a dtype change unless the policy fixed them.
                self.dbuffers[dbuffer_index] = dbuffer = DBuffer(
                    [s.shape for s in dbuffer.slots], [s.block_rows for s in dbuffer.slots], dtype, device, self.group,
                    param_dtype=self.mp_policy.param_dtype if dtype.is_floating_point else None,
                    reduce_dtype=self.mp_policy.reduce_dtype if dtype.is_floating_point else None,
                    layout=dbuffer.layout,
                )
                self.dbuffers[dbuffer_index].label = label
                if self.root is not None:
                    dbuffer.use_storage_pool(self.root._storage_pool)
            for m, old_local in zip(members, locals_):
                view = dbuffer.sharded_view(m.slot_index)
                if old_local.device.type != "meta":
                    with torch.no_grad():
                        view.copy_(old_local)
                set_local_tensor(m.sharded, view)
                m.unsharded = None

    def adopt_assigned(self, m: ManagedParam, value: nn.Parameter) -> nn.Parameter | None:
        """``module.<name> = value`` on a managed parameter (``load_state_dict(assign=True)``
        too): keep the sharded DTensor in its DBuffer and take ``value``'s data for this rank.

        ``value`` is the full parameter (a plain tensor) or a DTensor of any placement over this
        unit's mesh (a sharded state dict). Returns the parameter to register.
        """
        if value is m.sharded or value is m.unsharded:
            return None
        if tuple(value.shape) != tuple(m.sharded.shape):
            raise ValueError(
                f"cannot assign a tensor of shape {tuple(value.shape)} to {m.fqn!r}, a parameter of "
                f"shape {tuple(m.sharded.shape)} sharded by fully_shard; assign a tensor of the same shape"
            )
        if self.is_unsharded or self._pending_unshard:
            self.reshard()
        if value.device.type == "meta":
            return m.sharded
        if self.dbuffers[m.buffer_index].sharded.device.type == "meta":
            # Assigned over a meta-initialised unit: its buffer moves to the value's device
            # (what to_empty would do; new DTensors, as to_empty makes, since a DTensor's
            # device is fixed); the other parameters wait for their own values.
            for member in self._members[m.buffer_index]:
                old = member.sharded
                local = torch.empty(old._local_tensor.shape, dtype=old.dtype, device=value.device)
                member.sharded = nn.Parameter(make_dtensor(local, old.device_mesh, old.placements, old.shape, old.stride()), requires_grad=old.requires_grad)
                member.register(member.sharded)
            self.readopt_sharded_params()
        dbuffer = self.dbuffers[m.buffer_index]
        slot = dbuffer.slots[m.slot_index]
        with torch.no_grad():
            if isinstance(value, DTensor):
                same = value.placements == m.sharded.placements and value.device_mesh == m.sharded.device_mesh
                local = value.to_local() if same else value.redistribute(m.sharded.device_mesh, m.sharded.placements).to_local()
            else:
                full = value.detach() if m.parallel is None else m.parallel.local_part(value.detach()).contiguous()
                start = self.rank * dbuffer.shard_size + slot.local_offset - slot.global_offset
                local = full.reshape(-1)[start : start + slot.local_length]
            dbuffer.sharded_view(m.slot_index).reshape(-1).copy_(local.reshape(-1))
        return m.sharded

    # -- unshard / reshard ------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return all(b.is_unsharded for b in self.dbuffers)

    def _check_materialized(self) -> None:
        for m in self.managed:
            if m.sharded.device.type == "meta":
                raise RuntimeError(
                    f"parameter {m.fqn!r} is still on the meta device: call module.to_empty(device=...) "
                    "and initialise it (e.g. reset_parameters()) before running forward"
                )

    def unshard(self, async_op: bool = False) -> None:
        """All-gather every DBuffer in place; with ``async_op`` the caller waits later."""
        if self.is_unsharded or self._pending_unshard:
            return
        self._check_materialized()
        with _outside_functorch():
            self._pending_unshard = [b.all_gather(async_op=async_op) for b in self.dbuffers]

    def wait_for_unshard(self) -> None:
        with _outside_functorch():
            for work in self._pending_unshard:
                work.wait()
        self._pending_unshard = []

    def use_unsharded_params(self) -> None:
        """Register the unsharded parameters (views of the unsharded buffers) in the modules."""
        self.unshard()
        self.wait_for_unshard()
        for m in self.managed:
            if m.unsharded is None:
                dbuffer = self.dbuffers[m.buffer_index]
                view = dbuffer.unsharded_view(m.slot_index)
                gathered = view if m.parallel is None else m.parallel.unsharded_param(view)
                m.unsharded = nn.Parameter(gathered, requires_grad=m.sharded.requires_grad)
                if m.unsharded.requires_grad:
                    m.unsharded.register_post_accumulate_grad_hook(self._after_gradient)
            m.register(m.unsharded)

    def register_state_dict_hooks(self) -> None:
        """Reshard before ``state_dict()``/``load_state_dict()`` so both see the sharded params."""
        owners = {id(module): module for m in self.managed for module, _ in m.owners}
        for module in owners.values():
            module.register_state_dict_pre_hook(lambda *args, **kwargs: self.reshard())
            module._register_load_state_dict_pre_hook(lambda *args, **kwargs: self.reshard())

    def reshard_to_post_forward_group(self) -> None:
        """``reshard_after_forward=k``: keep the parameters sharded over groups of k
        consecutive ranks until backward, which gathers within those k ranks only (FSDP2's
        memory and traffic: 1/k of the unit per rank)."""
        self.wait_for_unshard()
        group = _post_forward_group(self.mesh, self.reshard_after_forward)
        for m in self.managed:
            m.register(m.sharded)
        for b in self.dbuffers:
            b.reshard_to_group(group)

    def reshard(self) -> None:
        """Free the unsharded buffers and register the sharded parameters again."""
        self.wait_for_unshard()
        for m in self.managed:
            m.register(m.sharded)
        for b in self.dbuffers:
            b.release_unsharded()

    # -- forward ----------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._iteration.pre_backward_done:
            # Activation checkpointing recomputes this forward inside the unit's backward: the
            # backward owns the parameters' state, so only make sure they are unsharded (an
            # earlier post-backward of a unit run twice may have resharded them), as FSDP2.
            self.use_unsharded_params()
            return self._cast_forward_inputs(args, kwargs)
        if self._modules_run:
            self._modules_run.add(id(module))
            return self._cast_forward_inputs(args, kwargs)  # every module of a grouped unit
        self._modules_run.add(id(module))
        if self.root is None:
            self._lazy_init_as_root()
        root = self.root
        if root is self and root._forward_order:
            root._previous_forward_order, root._forward_order = root._forward_order, []
        if torch.is_grad_enabled():
            root._forward_order.append(self)
        self.use_unsharded_params()
        for unit in self._forward_prefetch_targets():
            unit.unshard(async_op=True)
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        if torch.is_grad_enabled():
            self._iteration.reduced = False
            self._iteration.pre_backward_done = False
            args, kwargs = self._attach_post_backward((args, kwargs))
        return args, kwargs

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``MixedPrecisionPolicy(cast_forward_inputs=True)``: floating-point inputs to
        ``param_dtype``, wherever they are nested (as FSDP2: lists, dicts, dataclasses)."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return _cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            return _cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _forward_prefetch_targets(self) -> list[FSDPUnit]:
        """The units set by ``set_modules_to_forward_prefetch``, else the unit that ran next
        in the previous training forward.

        On CUDA, FSDP2 overlaps the next all-gather with compute implicitly (the CPU runs
        ahead of the GPU and issues it early); a CPU backend has no run-ahead, so the next
        unit is gathered explicitly. It costs one more unit's parameters during forward.
        """
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = self.root._previous_forward_order
        if self not in order:
            return []
        position = order.index(self) + 1
        return [order[position]] if position < len(order) and order[position] is not self else []

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self._iteration.pre_backward_done:
            return self._cast_output(output)  # a recomputation (see pre_forward)
        if len(self._modules_run) < len(self.modules):
            return self._cast_output(output)  # each module of a grouped unit, as FSDP2
        output = self._complete_forward(output)
        if self.root is self:
            output = self._complete_partial_forwards(output)
            # The loss and the start of backward (usual peaks) hold no pooled memory.
            self._storage_pool.clear()
        return self._cast_output(output)

    def _complete_forward(self, output: Any) -> Any:
        self._modules_run.clear()
        if self._reshards_after_forward():
            if _is_group_size(self.reshard_after_forward) and torch.is_grad_enabled():
                self.reshard_to_post_forward_group()
            else:
                self.reshard()
        if torch.is_grad_enabled():
            output = _register_on_tensors(output, self._pre_backward_hook)
        return output

    def _complete_partial_forwards(self, output: Any) -> Any:
        """(Root, end of forward) Finish the forward of grouped units some of whose modules
        did not run (a chunked loss calls the head after forward), on the root's output, as
        FSDP2 does: they reshard, and their backward starts with the root's."""
        for unit in reversed(self._root_units):
            if unit is not self and unit._modules_run:
                output = unit._complete_forward(output)
        return output

    def _reshards_after_forward(self) -> bool:
        if not torch.is_grad_enabled():
            return True  # no backward will need the parameters (evaluation, inference)
        if self.reshard_after_forward is None:
            return self.root is not self
        return self.reshard_after_forward

    def _lazy_init_as_root(self) -> None:
        """The first unit to run forward is the root of every unit below its modules."""
        units = []
        for module in self.modules:
            for sub in module.modules():
                unit = getattr(sub, "_vescale_fsdp_unit", None)
                if unit is not None and unit not in units:
                    units.append(unit)
        for unit in units:
            if unit.root is not None and unit.root is not self:
                continue
            unit.root = self
            unit._check_materialized()
        self._root_units = [u for u in units if u.root is self]
        for unit in self._root_units:
            for dbuffer in unit.dbuffers:
                dbuffer.use_storage_pool(self._storage_pool)
        for root_module in self.modules:
            for name, module in root_module.named_modules():
                unit = getattr(module, "_vescale_fsdp_unit", None)
                if unit in self._root_units and module is unit.modules[0]:
                    for dbuffer in unit.dbuffers:
                        dbuffer.label = name or "<root>"

    # -- backward ---------------------------------------------------------------------

    def _attach_post_backward(self, inputs: Any) -> Any:
        tensors = _tensors_requiring_grad(inputs)
        if not tensors or torch._C._are_functorch_transforms_active():
            # (under torch.func transforms the final callback reduces the unit instead)
            return inputs
        self._iteration.pending_post_backward += 1
        outs = _PostBackward.apply(self, *tensors)
        replacements = iter(outs if isinstance(outs, tuple) else (outs,))
        return _map_grad_tensors(inputs, lambda t: next(replacements))

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        if self._iteration.pre_backward_done:
            return
        self._iteration.pre_backward_done = True
        root = self.root
        if not root._iteration_callback_queued:
            root._iteration_callback_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)
        self.use_unsharded_params()
        self._iteration.backward_prefetched = False
        if not any(m.sharded.requires_grad for m in self.managed):
            self._prefetch_for_backward()

    def _prefetch_for_backward(self) -> None:
        """Start gathering the unit(s) whose backward comes next.

        A unit with gradients does this at its first gradient rather than at its pre-backward
        (where FSDP2 does): the backward ops before that gradient have then released the
        activation gradients they consumed (for an output head, the logits' gradient, often the
        largest tensor of the step), so the prefetched parameters do not add to that moment.
        """
        if self._iteration.backward_prefetched:
            return
        self._iteration.backward_prefetched = True
        for unit in self._backward_prefetch_targets():
            unit.unshard(async_op=True)

    _iteration_callback_queued = False

    def _backward_prefetch_targets(self) -> list[FSDPUnit]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root._forward_order
        if self not in order:
            return []
        position = order.index(self)
        for earlier in reversed(order[:position]):
            if earlier is not self and not earlier._iteration.pre_backward_done:
                return [earlier]
        return []

    def _after_gradient(self, param: nn.Parameter) -> None:
        """At the unit's first gradient: finish the previous unit's reduce-scatter, then start
        gathering the unit whose backward comes next.

        The reduce-scatter has overlapped this unit's backward up to here; finishing it frees
        its gradient buffer before the prefetch allocates, so the two are never alive at once.
        """
        if not self._iteration.backward_prefetched:
            self.root.wait_for_reduces()
        self._prefetch_for_backward()

    def post_backward(self) -> None:
        """Reshard, then reduce-scatter the unit's gradients (unless accumulating without sync).

        Resharding first frees the unsharded parameters before the reduce-scatter allocates.
        """
        if self._iteration.reduced:
            return
        self._iteration.reduced = True
        self._prefetch_for_backward()  # if no gradient reached this unit
        if self.reshard_after_backward:
            self.reshard()
        if self.requires_gradient_sync:
            self._reduce_gradients()
        else:
            self._accumulate_in_reduce_dtype()

    def _accumulate_in_reduce_dtype(self) -> None:
        """Without sync, move each gradient into an accumulator in the reduce dtype where it
        differs from the gradient's (bf16 compute, fp32 reduce), as FSDP2 does; otherwise
        autograd keeps accumulating on the parameter in place."""
        for m in self.managed:
            grad = m.gathered_grad()
            if grad is None:
                continue
            reduce_dtype = self.dbuffers[m.buffer_index].reduce_dtype
            if m.accumulated_grad is None and grad.dtype == reduce_dtype:
                continue
            m.unsharded.grad = None
            if m.accumulated_grad is None:
                m.accumulated_grad = grad.to(reduce_dtype)
            else:
                m.accumulated_grad.add_(grad)

    def _reduce_gradients(self) -> None:
        """Move the unit's gradients into its gradient buffers and reduce-scatter them
        asynchronously (at most one unit in flight).

        Called after resharding, as FSDP2 chunk-cats after resharding: the buffer is allocated
        once the unsharded parameters are freed and the previous unit's reduce-scatter (which
        overlapped this unit's backward) is finished, so one unit's full gradients are alive
        at a time, the root's aside. Autograd's gradients are copied in (one copy each: its
        backward ops always write fresh tensors) and freed as they are copied. The root waits
        for the last reduce-scatters at the end of backward.
        """
        root = self.root
        root.wait_for_reduces()
        for dbuffer_index, dbuffer in enumerate(self.dbuffers):
            members = [m for m in self._members[dbuffer_index] if m.sharded.requires_grad]
            if not members:
                continue
            # Every rank reduces every unit that ran backward, gradients or not (another rank's
            # data may have reached parameters this one's did not): slices no gradient reached
            # are zeroed.
            grads = {}
            for m in members:
                grad = m.gathered_grad()
                if m.unsharded is not None:
                    m.unsharded.grad = None
                if m.accumulated_grad is not None:
                    grad = m.accumulated_grad if grad is None else m.accumulated_grad.add_(grad)
                    m.accumulated_grad = None
                grads[m.slot_index] = grad
            got = [grads[m.slot_index] is not None for m in members]
            dbuffer.fill_unsharded_grad(grads)
            accumulate = any(m.sharded.grad is not None for m in members)
            if accumulate:
                # Gradients set to None since the last step restart from zero in the buffer.
                for m in members:
                    if m.sharded.grad is None:
                        dbuffer.sharded_grad_view(m.slot_index).zero_()
            replicate_group = self.replicate_group
            if replicate_group is not None and not self.requires_all_reduce:
                # HSDP accumulating without the all-reduce (FSDP2's set_requires_all_reduce):
                # the shard group's sums wait in a partial buffer; no gradient is attached yet.
                root._reduces_in_flight.append(dbuffer.reduce_scatter(1.0, accumulate=False, async_op=True, partial=True))
                continue
            handle = dbuffer.reduce_scatter(self.gradient_divide_factor, accumulate=accumulate, async_op=True, replicate_group=replicate_group)
            handle.after_wait = functools.partial(_run_post_accumulate_grad_hooks, members)
            root._reduces_in_flight.append(handle)
            for m, received in zip(members, got):
                if m.sharded.grad is not None:
                    continue
                if received:
                    self._attach_sharded_grad(m)
                else:
                    root._reduced_without_local_grad.append((m, self, dbuffer.sharded_grad))

    def _attach_sharded_grad(self, m: ManagedParam) -> None:
        local = self.dbuffers[m.buffer_index].sharded_grad_view(m.slot_index)
        m.sharded.grad = make_dtensor(local, m.sharded.device_mesh, m.sharded.placements, m.sharded.shape, m.sharded.stride())

    def _attach_remote_gradients(self) -> None:
        """(Root, once every reduce-scatter of the backward is done) Give a gradient to each
        parameter this rank's data never reached but another rank's did.

        With data-dependent routing (mixture-of-experts layers, conditional branches) a
        parameter can get gradients on some ranks only. Its reduce-scatter already carried the
        other ranks' contributions and a presence flag per parameter (see DBuffer): a
        parameter some rank had a gradient for gets the reduced gradient on every rank (so
        every shard steps), one no rank's data reached keeps ``grad=None`` on every rank (so
        optimizers skip it everywhere), as under DDP. Ranks that had every gradient read
        nothing back; the others read one small flag vector per buffer.
        """
        pending, self._reduced_without_local_grad = self._reduced_without_local_grad, []
        by_buffer: dict[tuple[int, int], list[ManagedParam]] = {}
        owners: dict[tuple[int, int], tuple[FSDPUnit, torch.Tensor]] = {}
        for m, unit, sharded_grad in pending:
            key = (id(unit), m.buffer_index)
            by_buffer.setdefault(key, []).append(m)
            owners[key] = (unit, sharded_grad)
        for key, members in by_buffer.items():
            unit, sharded_grad = owners[key]
            received = unit.dbuffers[members[0].buffer_index].received_gradient(sharded_grad, [m.slot_index for m in members])
            attached = []
            for m, got in zip(members, received):
                if got and m.sharded.grad is None:
                    unit._attach_sharded_grad(m)
                    attached.append(m)
            _run_post_accumulate_grad_hooks(attached)

    def wait_for_reduces(self) -> None:
        """(Root) complete every reduce-scatter in flight, freeing their gradient buffers."""
        for handle in self._reduces_in_flight:
            handle.wait()
        self._reduces_in_flight = []

    def _final_callback(self) -> None:
        """End of backward: reduce every unit the per-input hooks did not reach, wait for
        every reduce-scatter (gradients are final when ``backward()`` returns), reset state."""
        self._iteration_callback_queued = False
        for unit in reversed(self._root_units):
            unit._modules_run.clear()  # a grouped unit's partial calls after forward (chunks)
            if not unit._iteration.reduced and unit._iteration.pre_backward_done:
                unit.post_backward()
            unit._iteration.pending_post_backward = 0
            unit._iteration.pre_backward_done = False
        self.wait_for_reduces()
        if self._reduced_without_local_grad:
            self._attach_remote_gradients()
        if self.reshard_after_backward:
            for unit in self._root_units:
                if unit.is_unsharded and unit._iteration.reduced:
                    unit.reshard()
        self._storage_pool.clear()  # the optimizer step holds no pooled memory

    def reset_iteration(self) -> None:
        """(Root) After an exception aborted a forward or backward: finish every collective
        in flight, reshard every unit and forget the iteration (its unreduced gradients and
        no-sync accumulation are dropped), as FSDP2's ``reset_iter_state``."""
        if self.root is not None and self.root is not self:
            raise RuntimeError(
                "reset_iter_state() must be called on the root module (the one fully_shard was "
                "applied to last, which runs forward first), not on a unit inside it"
            )
        units = self._root_units or _iter_units(self.modules)
        for handle in self._reduces_in_flight:
            handle.after_wait = None  # the aborted iteration's gradients trigger no hooks
        self.wait_for_reduces()
        self._reduced_without_local_grad = []
        self._iteration_callback_queued = False
        self._forward_order = []
        for unit in units:
            unit.wait_for_unshard()
            unit._iteration = _IterationState()
            unit._modules_run.clear()
            for m in unit.managed:
                m.accumulated_grad = None
                if m.unsharded is not None:
                    m.unsharded.grad = None
            unit.reshard()
            for dbuffer in unit.dbuffers:
                dbuffer.release_unsharded_grad()

    def _post_backward_from_inputs(self) -> None:
        self._iteration.pending_post_backward -= 1
        if self._iteration.pending_post_backward <= 0 and self._iteration.pre_backward_done:
            self.post_backward()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, unit: FSDPUnit, *inputs: torch.Tensor) -> Any:
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.unit._post_backward_from_inputs()
        return (None, *grads)


def _outside_functorch() -> Any:
    """The buffers' in-place refills are the runtime's, not the traced function's: hide them
    from an active ``torch.func`` transform (``jvp``, ``vmap``), as FSDP2 does."""
    return torch._C._DisableFuncTorch() if torch._C._are_functorch_transforms_active() else contextlib.nullcontext()


def _is_group_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# One set of k-rank groups per (mesh, k), shared by every unit that reshards to k ranks.
_POST_FORWARD_GROUPS: dict[tuple[int, int], torch.distributed.ProcessGroup] = {}


def _post_forward_group(mesh: DeviceMesh, k: int) -> torch.distributed.ProcessGroup:
    """This rank's group of k consecutive ranks of the shard dim (every rank creates all of
    them, in the same order, at the first forward that needs them)."""
    key = (id(mesh), k)
    if key not in _POST_FORWARD_GROUPS:
        rows = mesh.mesh.reshape(-1, mesh.size(mesh.ndim - 1)).tolist()
        enumeration = [row[i : i + k] for row in rows for i in range(0, len(row), k)]
        _POST_FORWARD_GROUPS[key], _ = torch.distributed.new_subgroups_by_enumeration(enumeration)
    return _POST_FORWARD_GROUPS[key]


def _run_post_accumulate_grad_hooks(members: list[ManagedParam]) -> None:
    """Hooks users registered on the sharded parameters run once the reduced sharded
    gradient is final (optimizer-in-backward steps there), as FSDP2's do."""
    for m in members:
        hooks = getattr(m.sharded, "_post_accumulate_grad_hooks", None)
        if hooks and m.sharded.grad is not None:
            for hook in list(hooks.values()):
                hook(m.sharded)


def _map_grad_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor that requires grad in a module's inputs or outputs:
    pytree containers (tuples, lists, dicts, named tuples, Hugging Face's ``ModelOutput``) and
    dataclasses, which pytree leaves whole (FSDP2 traverses them too)."""
    flat, spec = pytree.tree_flatten(tree)
    for i, leaf in enumerate(flat):
        if torch.is_tensor(leaf):
            if leaf.requires_grad:
                flat[i] = fn(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: _map_grad_tensors(getattr(leaf, f.name), fn) for f in dataclasses.fields(leaf) if f.init}
            flat[i] = dataclasses.replace(leaf, **fields)
    return pytree.tree_unflatten(flat, spec)


def _tensors_requiring_grad(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_grad_tensors(tree, lambda t: found.append(t) or t)
    return found


def _register_on_tensors(output: Any, hook: Callable[[torch.Tensor], None]) -> Any:
    for t in _tensors_requiring_grad(output):
        t.register_hook(hook)
    return output


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return _apply_to_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)


def _local(param: torch.Tensor) -> torch.Tensor:
    """What a unit's DBuffer holds of a parameter: a DTensor's (TP/EP) local tensor."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "meta" or b.device.type == "meta":
        return False
    return a.data_ptr() == b.data_ptr() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _iter_units(modules: Iterable[nn.Module]) -> list[FSDPUnit]:
    units: list[FSDPUnit] = []
    for module in modules:
        for sub in module.modules():
            unit = getattr(sub, "_vescale_fsdp_unit", None)
            if unit is not None and unit not in units:
                units.append(unit)
    return units


# Which (module, name) slots hold a managed parameter, so that assigning to one (meta-device
# init followed by ``module.w = nn.Parameter(t)``, ``load_state_dict(assign=True)``) lands
# in the unit's DBuffer instead of silently replacing the sharded parameter (FSDP2 adopts such
# assignments too).
_MANAGED_SLOTS: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[FSDPUnit, ManagedParam]]]" = weakref.WeakKeyDictionary()


def _adopt_assigned_parameter(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
    slots = _MANAGED_SLOTS.get(module)
    if not slots or name not in slots:
        return None
    unit, managed = slots[name]
    return unit.adopt_assigned(managed, param)


nn.modules.module.register_module_parameter_registration_hook(_adopt_assigned_parameter)

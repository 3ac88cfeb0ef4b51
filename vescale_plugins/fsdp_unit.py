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

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.utils import _apply_to_tensors
from torch.utils import _pytree as pytree

from ._dtensor_bridge import make_dtensor, set_local_tensor
from .dbuffer import DBuffer, GatherHandle, ReduceScatterHandle
from .placement import RaggedShard

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
        params: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter, int]],
        mesh: DeviceMesh,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.mesh = mesh
        self.group = mesh.get_group(0)
        self.world_size = mesh.size(0)
        self.rank = mesh.get_local_rank(0)
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.mp_policy = mp_policy
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float = float(self.world_size)
        self.is_last_backward = True
        self.find_unused_parameters = False  # the root's decides (see _exchange_gradient_presence)
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
        # (Root) parameters reduced this backward without a local gradient, with the sharded
        # gradient buffer that holds what other ranks sent them (see _exchange_gradient_presence).
        self._reduced_without_local_grad: list[tuple[ManagedParam, FSDPUnit, torch.Tensor]] = []
        self._reduced_this_backward = False
        self.managed = self._build(params)

    # -- construction -----------------------------------------------------------------

    def _build(self, params: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter, int]]) -> list[ManagedParam]:
        """Plan and allocate one DBuffer per (dtype, requires_grad) group; shard into it."""
        groups: dict[tuple[torch.dtype, bool], list[int]] = {}
        for i, (_, _, param, _) in enumerate(params):
            groups.setdefault((param.dtype, param.requires_grad), []).append(i)
        self.dbuffers: list[DBuffer] = []
        managed: list[ManagedParam | None] = [None] * len(params)
        for (dtype, requires_grad), indices in groups.items():
            device = params[indices[0]][2].device
            dbuffer = DBuffer(
                [params[i][2].shape for i in indices],
                [params[i][3] for i in indices],
                dtype,
                device,
                self.group,
                param_dtype=self.mp_policy.param_dtype if dtype.is_floating_point else None,
                reduce_dtype=self.mp_policy.reduce_dtype if dtype.is_floating_point else None,
            )
            self.dbuffers.append(dbuffer)
            for slot_index, i in enumerate(indices):
                fqn, owners, param, _ = params[i]
                sharded = nn.Parameter(self._shard_into(dbuffer, slot_index, param), requires_grad=requires_grad)
                managed[i] = ManagedParam(fqn, owners, sharded, len(self.dbuffers) - 1, slot_index, original=weakref.ref(param))
        result = [m for m in managed if m is not None]
        for m in result:
            m.register(m.sharded)
        # Which parameters live in which DBuffer is fixed here; per-step code reads it.
        self._members: list[list[ManagedParam]] = [[m for m in result if m.buffer_index == i] for i in range(len(self.dbuffers))]
        return result

    def _placement(self, dbuffer: DBuffer, slot_index: int) -> RaggedShard:
        slot = dbuffer.slots[slot_index]
        return RaggedShard((0,) if len(slot.shape) else (), slot.local_units)

    def _shard_into(self, dbuffer: DBuffer, slot_index: int, param: torch.Tensor) -> torch.Tensor:
        """Copy this rank's part of ``param`` into the sharded buffer once; return the DTensor."""
        slot = dbuffer.slots[slot_index]
        local = dbuffer.sharded_view(slot_index)
        if param.device.type != "meta":
            with torch.no_grad():
                flat = param.detach().reshape(-1)
                start = self.rank * dbuffer.shard_size + slot.local_offset - slot.global_offset
                local.reshape(-1).copy_(flat[start : start + slot.local_length])
        return make_dtensor(local, self.mesh, [self._placement(dbuffer, slot_index)], slot.shape, _contiguous_stride(slot.shape))

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
            for m, old_local in zip(members, locals_):
                view = dbuffer.sharded_view(m.slot_index)
                if old_local.device.type != "meta":
                    with torch.no_grad():
                        view.copy_(old_local)
                set_local_tensor(m.sharded, view)
                m.unsharded = None

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
        self._pending_unshard = [b.all_gather(async_op=async_op) for b in self.dbuffers]

    def wait_for_unshard(self) -> None:
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
                m.unsharded = nn.Parameter(dbuffer.unsharded_view(m.slot_index), requires_grad=m.sharded.requires_grad)
                if m.unsharded.requires_grad:
                    m.unsharded.register_post_accumulate_grad_hook(self._after_gradient)
            m.register(m.unsharded)

    def register_state_dict_hooks(self) -> None:
        """Reshard before ``state_dict()``/``load_state_dict()`` so both see the sharded params."""
        owners = {id(module): module for m in self.managed for module, _ in m.owners}
        for module in owners.values():
            module.register_state_dict_pre_hook(lambda *args, **kwargs: self.reshard())
            module._register_load_state_dict_pre_hook(lambda *args, **kwargs: self.reshard())

    def reshard(self) -> None:
        """Free the unsharded buffers and register the sharded parameters again."""
        self.wait_for_unshard()
        for m in self.managed:
            m.register(m.sharded)
        for b in self.dbuffers:
            b.release_unsharded()

    # -- forward ----------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
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
        ``param_dtype``, wherever they are nested (as FSDP2, see ``_cast_forward_inputs``)."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return _cast_forward_inputs(self.mp_policy.param_dtype, args, kwargs)
        return args, kwargs

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
        if len(self._modules_run) < len(self.modules):
            return output
        self._modules_run.clear()
        if self._reshards_after_forward():
            self.reshard()
        if torch.is_grad_enabled():
            output = _register_on_tensors(output, self._pre_backward_hook)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
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
        for root_module in self.modules:
            for name, module in root_module.named_modules():
                unit = getattr(module, "_vescale_fsdp_unit", None)
                if unit in self._root_units and module is unit.modules[0]:
                    for dbuffer in unit.dbuffers:
                        dbuffer.label = name or "<root>"

    # -- backward ---------------------------------------------------------------------

    def _attach_post_backward(self, inputs: Any) -> Any:
        flat, spec = pytree.tree_flatten(inputs)
        positions = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if positions:
            self._iteration.pending_post_backward += 1
            outs = _PostBackward.apply(self, *(flat[i] for i in positions))
            for i, out in zip(positions, outs if isinstance(outs, tuple) else (outs,)):
                flat[i] = out
        return pytree.tree_unflatten(flat, spec)

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
                grads[m.slot_index] = m.unsharded.grad if m.unsharded is not None else None
                if m.unsharded is not None:
                    m.unsharded.grad = None
            got = [grads[m.slot_index] is not None for m in members]
            dbuffer.fill_unsharded_grad(grads)
            accumulate = any(m.sharded.grad is not None for m in members)
            if accumulate:
                # Gradients set to None since the last step restart from zero in the buffer.
                for m in members:
                    if m.sharded.grad is None:
                        dbuffer.sharded_grad_view(m.slot_index).zero_()
            root._reduces_in_flight.append(dbuffer.reduce_scatter(self.gradient_divide_factor, accumulate=accumulate, async_op=True))
            root._reduced_this_backward = True
            for m, received in zip(members, got):
                if m.sharded.grad is not None:
                    continue
                if received:
                    self._attach_sharded_grad(m)
                elif root.find_unused_parameters:
                    root._reduced_without_local_grad.append((m, self, dbuffer.sharded_grad))

    def _attach_sharded_grad(self, m: ManagedParam) -> None:
        local = self.dbuffers[m.buffer_index].sharded_grad_view(m.slot_index)
        m.sharded.grad = make_dtensor(local, self.mesh, m.sharded.placements, m.sharded.shape, m.sharded.stride())

    def _exchange_gradient_presence(self) -> Callable[[], None]:
        """(Root, end of a backward that reduced) Start agreeing on which parameters got a
        gradient on some rank; the returned function finishes and attaches gradients.

        With data-dependent routing (mixture-of-experts layers, conditional branches) a
        parameter can get gradients on some ranks only. Its reduce-scatter already carries the
        other ranks' contributions; one all-reduce of which parameters lacked a local gradient
        decides whether it has a gradient at all (DDP's ``find_unused_parameters`` does the
        same). A parameter no rank's data reached keeps ``grad=None``, so optimizers skip it.
        The all-reduce is issued before the last reduce-scatters are waited for, to overlap them.
        """
        pending, self._reduced_without_local_grad = self._reduced_without_local_grad, []
        members = [m for unit in self._root_units for m in unit.managed if m.sharded.requires_grad]
        index = {id(m): i for i, m in enumerate(members)}
        lacking = [0] * len(members)
        for m, _, _ in pending:
            lacking[index[id(m)]] = 1
        missing = torch.tensor(lacking, dtype=torch.int32, device=self._collective_device())
        # Every rank runs this after every reducing backward (same units, same order), so the
        # collective always matches; MIN over ranks: 0 where some rank had a gradient.
        work = torch.distributed.all_reduce(missing, op=torch.distributed.ReduceOp.MIN, group=self.group, async_op=True)

        def attach() -> None:
            work.wait()
            absent_everywhere = missing.tolist()
            for m, unit, _ in pending:  # (``pending`` holds the gradient buffers until here)
                if not absent_everywhere[index[id(m)]] and m.sharded.grad is None:
                    unit._attach_sharded_grad(m)

        return attach

    def _collective_device(self) -> torch.device:
        return next((b.device for unit in self._root_units for b in unit.dbuffers), torch.device("cpu"))

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
            if not unit._iteration.reduced and unit._iteration.pre_backward_done:
                unit.post_backward()
            unit._iteration.pending_post_backward = 0
            unit._iteration.pre_backward_done = False
        exchange = self.find_unused_parameters and self._reduced_this_backward
        self._reduced_this_backward = False
        attach_remote_gradients = self._exchange_gradient_presence() if exchange else None
        self.wait_for_reduces()
        if attach_remote_gradients is not None:
            attach_remote_gradients()
        if self.reshard_after_backward:
            for unit in self._root_units:
                if unit.is_unsharded and unit._iteration.reduced:
                    unit.reshard()

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


def _register_on_tensors(output: Any, hook: Callable[[torch.Tensor], None]) -> Any:
    for t in pytree.tree_leaves(output):
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(hook)
    return output


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() and t.dtype != dtype else t, tree)


def _cast_forward_inputs(dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Floating-point tensors in ``args``/``kwargs`` to ``dtype``, reaching into lists, tuples,
    dicts, namedtuples and dataclasses (torch's ``_apply_to_tensors``, which FSDP2 uses)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)


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

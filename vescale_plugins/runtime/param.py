"""One managed parameter (FSDP2's ``FSDPParam``): its two faces and the operations on it.

Between steps a managed parameter is an ``nn.Parameter(DTensor)`` whose placement is
``RaggedShard`` and whose local tensor is a view of its DBuffer's sharded buffer (the
*sharded* face). Around its unit's forward and backward the modules see a plain
``nn.Parameter`` that is a view of the unsharded buffer (the *unsharded* face). Gradients
arrive on the unsharded face and leave as a view of the sharded gradient buffer.

Only the threads that train the modules see the unsharded face (:class:`ManagedParameters`):
any other thread (torchft's quorum thread building a heal's state dict, a checkpointing
thread) iterating the modules' parameters sees the sharded ones, the optimizer's own.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, ItemsView, Iterable, Sequence, ValuesView
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement

from vescale_plugins.dbuffer import DBuffer
from vescale_plugins.dbuffer.planning import row_numel
from vescale_plugins.ragged.dtensor import make_dtensor, set_local_tensor
from vescale_plugins.ragged.placement import RaggedShard
from vescale_plugins.runtime.extensions import ExtensionGather, defines_extension
from vescale_plugins.runtime.fsdp2_semantics import hand_gradients_over_in
from vescale_plugins.runtime.mesh import UnitMesh
from vescale_plugins.runtime.registry import register_sharded_face
from vescale_plugins.runtime.tensor_parallel import ParallelSpec

if TYPE_CHECKING:

    class ShardedParameter(nn.Parameter, DTensor):
        """The sharded face, ``nn.Parameter(dtensor)``: for a tensor subclass, torch's
        Parameter returns the subclass instance flagged as a parameter, so the face is a
        DTensor and passes ``isinstance(face, nn.Parameter)``. Both, for the type checker."""

else:
    ShardedParameter = DTensor

__all__ = [
    "FSDPParam",
    "ManagedParameters",
    "ShardedBuffer",
    "adopt_assigned_grads",
    "attach_sharded_grads",
    "is_training_thread",
    "manage_parameters",
    "mark_training_thread",
    "register_sharded_faces",
    "register_unsharded_faces",
    "take_gradients",
]

# Set on every thread that gathers a unit (forward, backward: on CUDA autograd runs backward
# on its own device threads; ``unshard()``): those threads see what the modules hold now.
# Thread-local, so a new thread never inherits a finished one's flag through a reused ident.
_TRAINING = threading.local()


def mark_training_thread() -> None:
    """This thread trains the modules: it sees their unsharded faces while they are gathered."""
    _TRAINING.trains = True


def is_training_thread() -> bool:
    return getattr(_TRAINING, "trains", False)


class ManagedParameters(dict):
    """``module._parameters`` of a module whose parameters ``fully_shard`` manages.

    A plain dict to the threads that train (``module.weight``, the forward, FSDP2's faces as
    they are registered). Iterated from any other thread (``named_parameters()``,
    ``state_dict()``, ``load_state_dict()``, DCP's ``get_optimizer_state_dict`` and
    ``set_model_state_dict``), each managed name reads its sharded face, whatever the unit
    holds at that moment: a heal's state dict built in torchft's quorum thread while this
    thread's forward runs names the optimizer's own parameters, as it does between steps, and
    touches nothing. Lookups by name (``__getitem__``, the forward's hot path) are dict's own.
    """

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        self.managed: dict[str, FSDPParam] = {}

    def _for_this_thread(self) -> dict[str, Any]:
        if is_training_thread() or not self.managed:
            return self
        return {name: self.managed[name].sharded if name in self.managed else p for name, p in dict.items(self)}

    def items(self) -> ItemsView[str, Any]:  # type: ignore[override]
        return dict.items(self._for_this_thread())

    def values(self) -> ValuesView[Any]:  # type: ignore[override]
        return dict.values(self._for_this_thread())

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Copied or pickled as the plain dict it replaced (a deep-copied module is unmanaged).
        return (dict, (list(dict.items(self)),))


def manage_parameters(fsdp_params: Iterable[FSDPParam]) -> None:
    """Make each owner module's ``_parameters`` a :class:`ManagedParameters` naming them."""
    for fsdp_param in fsdp_params:
        for module, name in fsdp_param.owners:
            params = module.__dict__["_parameters"]
            if not isinstance(params, ManagedParameters):
                params = ManagedParameters(params)
                module.__dict__["_parameters"] = params
            params.managed[name] = fsdp_param


@dataclass
class ShardedBuffer:
    """One DBuffer of a unit, the mesh it shards over, and the parameters it holds (in slot
    order). ``dbuffer`` is replaced when ``module.to()`` or ``to_empty()`` moves the unit;
    ``extensions`` gathers the parameters with all-gather extensions (made at their first).
    ``mp_policy`` is the unit's policy as it applies to these parameters (FSDP2 2.15's
    ``param_dtype_override_fn`` resolved: every parameter of a DBuffer has the same)."""

    dbuffer: DBuffer
    mesh: UnitMesh
    params: list[FSDPParam]
    mp_policy: MixedPrecisionPolicy
    extensions: ExtensionGather | None = None
    grad_dtype: torch.dtype | None = None  # set on the parameters before fully_shard (torch 2.15)

    def release_unused_shards(self) -> None:
        """Free the DBuffer's sharded buffer where no parameter keeps its data there (each is a
        subclass with all-gather extensions, whose local tensor has its own storage)."""
        sharded = self.dbuffer.sharded
        if self.params and all(p.owns_local for p in self.params) and sharded.device.type != "meta":
            sharded.untyped_storage().resize_(0)

    @property
    def is_unsharded(self) -> bool:
        extensions = self.extensions
        if extensions is None or not extensions.ran_on:
            return self.dbuffer.is_unsharded
        plain_too = len(extensions.ran_on) < len(self.params)
        return extensions.is_unsharded and (not plain_too or self.dbuffer.is_unsharded)


class FSDPParam:
    """One parameter of a unit.

    Args:
        fqn: its name under the unit's first module.
        owners: the ``(module, attribute)`` slots that hold it (several when tied).
        buffer, slot: where it lives (its DBuffer's ``slots[slot]``).
        original: the parameter ``fully_shard`` replaced; its data is copied in once.
        parallel: set when it was already a DTensor (tensor/expert parallel, SPMD mesh): the
            DBuffer holds its local tensor and the gathered parameter is that DTensor again.
    """

    def __init__(
        self,
        fqn: str,
        owners: tuple[tuple[nn.Module, str], ...],
        buffer: ShardedBuffer,
        slot: int,
        original: nn.Parameter,
        parallel: ParallelSpec | None,
    ) -> None:
        self.fqn, self.owners, self.buffer, self.slot, self.parallel = fqn, owners, buffer, slot, parallel
        # Weakly: a module outside the unit still holding it (a tied weight) is a parameter
        # shared across units, which an outer unit must refuse.
        self.original: Callable[[], nn.Parameter | None] = weakref.ref(original)
        self.unsharded: nn.Parameter | None = None
        self.unsharded_by_extension = False  # the unsharded face came from fsdp_post_all_gather
        # A tensor subclass with all-gather extensions keeps its sharded local tensor an
        # instance of its class with its own storage, as FSDP2's: the DBuffer slot only lays out
        # its gradient and its extension's inputs.
        self.owns_local = defines_extension(original)
        # Gradients of micro-batches that did not sync, in the reduce dtype when it differs from
        # the unsharded parameters' (FSDP2 accumulates there, not in bf16 on the parameter).
        self.accumulated_grad: torch.Tensor | None = None
        self.sharded = self._make_sharded(original)

    @property
    def dbuffer(self) -> DBuffer:
        return self.buffer.dbuffer

    @property
    def unit_mesh(self) -> DeviceMesh:
        """The mesh this parameter's unit shards over, the object ``fully_shard`` was given
        (the sharded face's ``device_mesh`` may be an equal copy: DTensor's sharding cache
        hands out the first equal mesh it saw)."""
        return self.buffer.mesh.mesh

    # -- the sharded face -------------------------------------------------------------

    def placements(self) -> list[Placement]:
        slot = self.dbuffer.slots[self.slot]
        return self.buffer.mesh.placements(slot.dims, slot.local_units)

    def slice_start(self) -> int:
        """Where this rank's part starts in the flattened (local TP) parameter."""
        dbuffer = self.dbuffer
        slot = dbuffer.slots[self.slot]
        return self.buffer.mesh.shard_rank * dbuffer.shard_size + slot.local_offset - slot.global_offset

    def _make_sharded(self, param: nn.Parameter) -> ShardedParameter:
        """Copy this rank's part of ``param`` into the sharded buffer once; the sharded face.

        A tensor-parallel parameter's slot is its local TP tensor; the DTensor lives on the
        (dp, tp) mesh with the ragged cut on the dp dim (see ``tensor_parallel``)."""
        slot = self.dbuffer.slots[self.slot]
        local = self.dbuffer.sharded_view(self.slot)
        if self.owns_local:
            rows = row_numel(slot.shape)
            with torch.no_grad():
                start = self.slice_start() // rows if slot.local_length else 0
                local = _local(param).detach().narrow(0, start, slot.local_length // rows).clone()
        elif param.device.type != "meta":
            with torch.no_grad():
                flat = _local(param).detach().reshape(-1)
                start = self.slice_start()
                local.reshape(-1).copy_(flat[start : start + slot.local_length])
        if self.parallel is not None:
            ragged = self.placements()[-1]
            assert isinstance(ragged, RaggedShard)  # UnitMesh.placements ends with it
            dtensor = make_dtensor(
                local,
                self.parallel.sharded_mesh,
                self.parallel.sharded_placements(ragged),
                self.parallel.shape,
                self.parallel.stride,
            )
        else:
            dtensor = make_dtensor(
                local, self.buffer.mesh.mesh, self.placements(), slot.shape, make_contiguous_strides_for(slot.shape)
            )
        sharded = cast("ShardedParameter", nn.Parameter(dtensor, requires_grad=param.requires_grad))
        self._keep_grad_dtype(sharded)
        register_sharded_face(sharded, self)
        return sharded

    def _keep_grad_dtype(self, sharded: nn.Parameter) -> None:
        """A ``grad_dtype`` set before ``fully_shard`` stays on the sharded face (torch 2.15)."""
        if self.buffer.grad_dtype is not None:
            sharded.grad_dtype = self.buffer.grad_dtype

    def replace_sharded(self, device: torch.device) -> None:
        """A new sharded face on ``device`` over the same layout (assignment onto a meta unit:
        a DTensor's device is fixed)."""
        old = self.sharded
        local = torch.empty(old._local_tensor.shape, dtype=old.dtype, device=device)
        self.sharded = cast(
            "ShardedParameter",
            nn.Parameter(
                make_dtensor(local, old.device_mesh, old.placements, old.shape, old.stride()),
                requires_grad=old.requires_grad,
            ),
        )
        self._keep_grad_dtype(self.sharded)
        register_sharded_face(self.sharded, self)
        self.register(self.sharded)

    def readopt_local(self, old_local: torch.Tensor) -> None:
        """Point the sharded face at its view of the (possibly new) DBuffer, copying what the
        replaced local tensor held."""
        self.unsharded = None
        if self.owns_local:
            return  # the sharded face keeps the local tensor it was given
        view = self.dbuffer.sharded_view(self.slot)
        if old_local.device.type != "meta":
            with torch.no_grad():
                view.copy_(old_local)
        set_local_tensor(self.sharded, view)

    def face_over_own_view(self) -> DTensor:
        """A DTensor like the sharded face over its view of the (new) DBuffer: what
        ``to_empty`` swaps into the face (see ``FSDPParamGroup.materialize_empty``)."""
        self.unsharded = None
        old = self.sharded
        return make_dtensor(
            self.dbuffer.sharded_view(self.slot), old.device_mesh, old.placements, old.shape, old.stride()
        )

    def holds_its_view(self) -> bool:
        """Whether the sharded face still is its view of the DBuffer (``to_empty``/``_apply``
        replace local tensors)."""
        local = self.sharded._local_tensor
        if self.owns_local:
            return local.device == self.dbuffer.sharded.device and local.dtype == self.dbuffer.dtype
        return _same_storage(local, self.dbuffer.sharded_view(self.slot)) and local.dtype == self.dbuffer.dtype

    def write_local(self, values: torch.Tensor) -> None:
        """Copy this rank's part (flat ``values``) into the sharded face's storage."""
        target = self.sharded._local_tensor if self.owns_local else self.dbuffer.sharded_view(self.slot)
        with torch.no_grad():
            target.reshape(-1).copy_(values.reshape(-1))

    def local_value_of(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``value``: a full tensor, or a DTensor of any placement over the
        parameter's mesh (a sharded state dict)."""
        if isinstance(value, DTensor):
            same = value.placements == self.sharded.placements and value.device_mesh == self.sharded.device_mesh
            return (
                value.to_local()
                if same
                else value.redistribute(self.sharded.device_mesh, self.sharded.placements).to_local()
            )
        full = value.detach() if self.parallel is None else self.parallel.local_part(value.detach()).contiguous()
        start = self.slice_start()
        return full.reshape(-1)[start : start + self.dbuffer.slots[self.slot].local_length]

    # -- the unsharded face -----------------------------------------------------------

    def to_unsharded(self, after_gradient: Callable[[nn.Parameter], None]) -> None:
        """Register the unsharded face in the modules: made at the first gather (or when the
        extension starts or stops being used), refilled in place after."""
        extensions = self.buffer.extensions
        by_extension = extensions is not None and self.slot in extensions.ran_on
        if by_extension != self.unsharded_by_extension:
            self.unsharded = None
        if by_extension:
            assert extensions is not None  # by_extension says so
            if self.slot in extensions.awaiting_post:  # once per all-gather, as FSDP2
                tensor = extensions.post_all_gather(self, self.dbuffer.param_dtype)
                if tensor is not None:
                    self._make_unsharded(tensor, after_gradient)
            self.unsharded_by_extension = True
        elif self.unsharded is None:
            view = self.dbuffer.unsharded_view(self.slot)
            self._make_unsharded(view if self.parallel is None else self.parallel.unsharded_param(view), after_gradient)
            self.unsharded_by_extension = False
        assert self.unsharded is not None  # made above or at an earlier gather
        self.register(self.unsharded)

    def restore_spmd_types(self) -> None:
        """A parameter annotated with spmd_types: its annotations on the gathered (plain)
        parameter again, when type checking is on (FSDP2's ``_restore_spmd_types``)."""
        if self.unsharded is not None and self.parallel is not None and self.parallel.spmd_types is not None:
            self.parallel.spmd_types.restore(self.unsharded)

    def _make_unsharded(self, gathered: torch.Tensor, after_gradient: Callable[[nn.Parameter], None]) -> None:
        self.unsharded = nn.Parameter(gathered, requires_grad=self.sharded.requires_grad)
        if self.unsharded.requires_grad:
            hand_gradients_over_in(self.unsharded, self.dbuffer.reduce_dtype)
            self.unsharded.register_post_accumulate_grad_hook(after_gradient)

    def register(self, param: nn.Parameter) -> None:
        # Bypass nn.Module.__setattr__: the parameter changes identity every forward.
        for module, name in self.owners:
            module._parameters[name] = param

    # -- gradients --------------------------------------------------------------------

    def gathered_grad(self) -> torch.Tensor | None:
        """The unsharded face's gradient as a local tensor (a TP DTensor's local shard)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None or self.parallel is None:
            return grad
        return self.parallel.local_grad(grad)

    def take_gradient(self) -> torch.Tensor | None:
        """The full gradient to reduce (with what accumulated without sync), detached from the
        parameter so the caller holds the only reference."""
        grad = self.gathered_grad()
        if self.unsharded is not None:
            self.unsharded.grad = None
        if self.accumulated_grad is not None:
            grad = self.accumulated_grad if grad is None else self.accumulated_grad.add_(grad)
            self.accumulated_grad = None
        return grad

    def accumulate_in(self, reduce_dtype: torch.dtype) -> None:
        """Without sync: move the gradient into an accumulator in ``reduce_dtype`` where it
        differs from the gradient's (bf16 compute, fp32 reduce), as FSDP2 does; otherwise
        autograd keeps accumulating on the parameter in place."""
        grad = self.gathered_grad()
        if grad is None or (self.accumulated_grad is None and grad.dtype == reduce_dtype):
            return
        assert self.unsharded is not None  # where the gradient came from
        self.unsharded.grad = None
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            self.accumulated_grad.add_(grad)

    def attach_sharded_grad(self) -> None:
        """``.grad`` of the sharded face: a DTensor view of the sharded gradient buffer."""
        attach_sharded_grads(self.dbuffer, [self])

    def adopt_assigned_grad(self) -> None:
        """A ``.grad`` assigned by the user (``p.grad = torch.zeros_like(p)``), not a view of the
        sharded gradient buffer, is copied into this parameter's view of it and replaced by
        that view, so that the coming reduction adds to its values: FSDP2 adds a new gradient
        to an assigned ``.grad`` (``grad._local_tensor += new``). Without this the reduction
        would land in the buffer and the assigned tensor would keep its old values."""
        grad = self.sharded.grad
        if grad is None:
            return
        view = self.dbuffer.sharded_grad_view(self.slot)  # holds the buffer while we copy
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        if local.numel() == 0 or (_same_storage(local, view) and local.storage_offset() == view.storage_offset()):
            return
        if isinstance(grad, DTensor) and (
            grad.placements != self.sharded.placements or grad.device_mesh != self.sharded.device_mesh
        ):
            local = grad.redistribute(self.sharded.device_mesh, self.sharded.placements).to_local()
        with torch.no_grad():
            view.copy_(local.reshape(view.shape))
        self.attach_sharded_grad()

    def run_post_accumulate_grad_hooks(self) -> None:
        """Hooks users registered on the sharded face run once its reduced gradient is final
        (optimizer-in-backward steps there), as FSDP2's do."""
        hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None)
        if hooks and self.sharded.grad is not None:
            self.dbuffer.wait_for_offloaded_grads()  # a hook reads the gradient on the host
            for hook in list(hooks.values()):
                hook(self.sharded)


def attach_sharded_grads(dbuffer: DBuffer, params: Sequence[FSDPParam]) -> None:
    """``.grad`` of each sharded face in ``params`` (all of ``dbuffer``): DTensor views of the
    sharded gradient buffer, cut in one pass over the buffer. The parameter's own spec (mesh,
    placements, shape, stride, dtype: the gradient's too) where the dtypes agree, as FSDP2
    builds its gradients from its cached sharding spec: no new spec per gradient per step."""
    new = DTensor.__new__  # wrap_local, inline (once per parameter per step)
    for fsdp_param, local in zip(params, dbuffer.sharded_grad_views([p.slot for p in params])):
        sharded = fsdp_param.sharded
        spec = sharded._spec
        if spec.tensor_meta is not None and spec.tensor_meta.dtype == local.dtype:
            grad = new(DTensor, local, spec, requires_grad=False)
        else:
            grad = make_dtensor(local, sharded.device_mesh, sharded.placements, sharded.shape, sharded.stride())
        sharded.grad = grad


def adopt_assigned_grads(dbuffer: DBuffer, params: Sequence[FSDPParam]) -> None:
    """:meth:`FSDPParam.adopt_assigned_grad` of each (all of ``dbuffer``) whose ``.grad`` is not
    the view of the sharded gradient buffer attached to it: asked inline, by storage and
    offset, without cutting a view (no weak reference either: ``swap_tensors`` refuses a
    tensor that has one)."""
    flat = dbuffer.sharded_grad
    storage = flat.untyped_storage().data_ptr() if flat is not None else None
    for p in params:
        grad = p.sharded.grad
        if grad is None:
            continue
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        if (
            storage is not None
            and local.numel()
            and local.untyped_storage().data_ptr() == storage
            and local.storage_offset() == dbuffer.grad_view_offset(p.slot)
        ):
            continue
        p.adopt_assigned_grad()


def take_gradients(params: Sequence[FSDPParam]) -> dict[int, torch.Tensor | None]:
    """:meth:`FSDPParam.take_gradient` of each, by slot; a plain parameter with nothing
    accumulated read inline (the common case, once per parameter per step)."""
    grads: dict[int, torch.Tensor | None] = {}
    for p in params:
        unsharded = p.unsharded
        if unsharded is not None and p.parallel is None and p.accumulated_grad is None:
            grads[p.slot] = unsharded.grad
            unsharded.grad = None
        else:
            grads[p.slot] = p.take_gradient()
    return grads


def register_unsharded_faces(
    params: Sequence[FSDPParam], after_gradient: Callable[[nn.Parameter], None]
) -> list[FSDPParam]:
    """Every parameter's unsharded face into its modules: the face made at an earlier gather
    set in place inline (a plain parameter of a buffer without extensions), else through
    :meth:`FSDPParam.to_unsharded`. Returns the parameters that took the latter."""
    slow = []
    for p in params:
        face = p.unsharded
        if face is None or p.unsharded_by_extension or p.parallel is not None or p.buffer.extensions is not None:
            p.to_unsharded(after_gradient)
            slow.append(p)
            continue
        for module, name in p.owners:
            module._parameters[name] = face
    return slow


def register_sharded_faces(params: Sequence[FSDPParam]) -> None:
    """Every parameter's sharded face into its modules."""
    for p in params:
        sharded = p.sharded
        for module, name in p.owners:
            module._parameters[name] = sharded


def _local(param: torch.Tensor) -> torch.Tensor:
    """What a unit's DBuffer holds of a parameter: a DTensor's (TP/EP) local tensor."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "meta" or b.device.type == "meta":
        return False
    return a.data_ptr() == b.data_ptr() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

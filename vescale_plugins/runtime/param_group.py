"""One unit at run time (FSDP2's ``FSDPParamGroup``): what one ``fully_shard`` call manages.

The unit holds its parameters (:class:`~vescale_plugins.runtime.param.FSDPParam`) in one or
more DBuffers, grouped by (mesh, dtype, requires_grad) and split where the planner says it
pays. Its forward gathers them (and starts the next unit's gather), its backward gathers
them again if they were resharded, and its post-backward moves autograd's gradients into the
gradient buffers, which leave by one reduce-scatter per DBuffer (then, under HSDP, one
all-reduce across replicas). What the units under one root share (the orders, the
reductions in flight) is below them, in :class:`~vescale_plugins.runtime.iteration.
IterationContext`; the end of backward is driven from above, by the root's
:class:`~vescale_plugins.runtime.state.RootState`, which the unit never calls.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from vescale_plugins.dbuffer import DBuffer
from vescale_plugins.dbuffer.faults import CollectiveError
from vescale_plugins.dbuffer.handles import AfterReduceScatter, GatherHandle, ReduceScatterHandle
from vescale_plugins.dbuffer.planning import BufferSplitCost, plan_buffers
from vescale_plugins.dbuffer.reduction import GradientReduction, gradient_reduction
from vescale_plugins.ragged.dtensor import sync_generator_at_next_draw, with_own_bytes
from vescale_plugins.runtime.comm_policy import QuantizedComm
from vescale_plugins.runtime.dynamo import eager_hook
from vescale_plugins.runtime.extensions import (
    EXTENSION_HOOK,
    ExtensionGather,
    check_extension_param,
    defines_extension,
)
from vescale_plugins.runtime.fsdp2_semantics import (
    default_reduce_dtype,
    defer_upcast,
    defers_upcast,
    grad_dtype_override,
    policy_for_param,
    register_spmd_local_autograd_function,
    spmd_no_typecheck,
    upcast_gradient,
)
from vescale_plugins.runtime.iteration import IterationContext, TrainingState, in_compiled_autograd
from vescale_plugins.runtime.mesh import UnitMesh, is_group_size, post_forward_group
from vescale_plugins.runtime.param import (
    FSDPParam,
    ManagedParameters,
    ShardedBuffer,
    adopt_assigned_grads,
    attach_sharded_grads,
    is_training_thread,
    manage_parameters,
    mark_training_thread,
    register_sharded_faces,
    register_unsharded_faces,
    take_gradients,
)
from vescale_plugins.runtime.registry import track_slots
from vescale_plugins.runtime.setup import ParamSpec
from vescale_plugins.runtime.traversal import (
    cast_floating,
    map_grad_tensors,
    outside_functorch,
    register_on_tensors,
    tensors_requiring_grad,
)

__all__ = ["FSDPParamGroup"]


class FSDPParamGroup:
    """The runtime of one ``fully_shard`` call (one unit).

    The attributes set by ``FSDPModule``'s setters (``reshard_after_forward``,
    ``requires_gradient_sync``, the prefetch lists, ...) are read here at run time.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        params: list[ParamSpec],
        mesh: DeviceMesh,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
        buffer_split_cost: BufferSplitCost,
        offload_policy: OffloadPolicy | None = None,
        comm_policy: QuantizedComm | None = None,
    ) -> None:
        self.modules = modules
        self.comm_policy = comm_policy
        # CPU offload: sharded parameters and gradients in host memory, computed with on the
        # mesh's device (FSDP2's CPUOffloadPolicy).
        self.offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
        self.mesh = mesh
        self.group = UnitMesh.of(mesh).shard_group  # the unit mesh's (each DBuffer has its own)
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        # FSDP2 2.15: set on the root before forward (set_manual_backward_finalization); a
        # unit whose reduction waits for finalize_backward; reshard keeps the gathered memory.
        self.manual_backward_finalization = False
        self.post_backward_pending = False
        self.keep_unsharded_storage = False
        self.reduced_partially = False  # HSDP sums held for a later all-reduce
        self.mp_policy = mp_policy
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.is_last_backward = True
        self.unshard_in_backward = True
        self.reduce_scatter_max_input_buffers = 1  # units whose reduce-scatters may be in flight
        # None: each DBuffer divides by its mesh's size (every data-parallel rank of it).
        self.gradient_divide_factor: float | None = None
        # FSDP2's set_all_reduce_hook: run on each reduce output (after HSDP's all-reduce).
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Any = None
        # Whether the hook sees the sum rather than the mean (the reduction itself always sums).
        self.force_sum_reduction_for_comms = False
        self.forward_prefetch: list[FSDPParamGroup] | None = None  # None: the next unit
        self.backward_prefetch: list[FSDPParamGroup] | None = None
        # Shared with the units under the same root; set at the first forward under a root
        # (the first unit to run forward is the root).
        self.context: IterationContext[FSDPParamGroup] | None = None
        self.training_state = TrainingState.IDLE
        self._pending_post_backward = 0  # _PostBackward nodes of this forward not yet run
        # Those nodes, weakly (whether a backward will run them, under compiled autograd).
        self.post_backward_nodes: list[weakref.ref[Any]] = []
        self._backward_prefetched = False
        # This backward's post-backward already ran once (see _pre_backward_hook).
        self._backward_again = False
        self._pending_unshard: list[GatherHandle] = []
        self._modules_run: set[int] = set()
        self.buffers: list[ShardedBuffer] = []
        self.fsdp_params = self._build(params, buffer_split_cost)
        self._register_state_dict_hooks()
        # Its parameters may be initialised next (meta init): the first draw syncs the seed.
        sync_generator_at_next_draw()

    # -- construction -----------------------------------------------------------------

    def _build(self, specs: list[ParamSpec], cost: BufferSplitCost) -> list[FSDPParam]:
        """The DBuffers of each (mesh, dtype, requires_grad) group, as many as the planner's
        split says, each parameter sharded into its slot."""
        # Subclasses with all-gather extensions apart: their DBuffers gather only their inputs;
        # parameters whose policy differs (param_dtype_override_fn) apart.
        policies = [policy_for_param(self.mp_policy, spec.param) for spec in specs]
        by_group: dict[tuple[DeviceMesh, torch.dtype, bool, bool, torch.dtype | None, torch.dtype | None], list[int]]
        by_group = {}
        for i, spec in enumerate(specs):
            key = (
                spec.mesh or self.mesh,
                spec.param.dtype,
                spec.param.requires_grad,
                defines_extension(spec.param),
                policies[i].param_dtype,
                grad_dtype_override(spec.param),
            )
            by_group.setdefault(key, []).append(i)
        meshes = {self.mesh: UnitMesh.of(self.mesh)}
        built: list[FSDPParam | None] = [None] * len(specs)
        for (mesh, dtype, *_, grad_dtype), indices in by_group.items():
            unit_mesh = meshes.setdefault(mesh, UnitMesh.of(mesh))
            members = [specs[i] for i in indices]
            policy = policies[indices[0]]
            shapes, block_rows = [s.local.shape for s in members], [s.block_rows for s in members]
            comm_dtype = (policy.param_dtype or dtype) if dtype.is_floating_point else dtype
            quant_block = self.comm_policy.quant_block if self.comm_policy and dtype.is_floating_point else None
            for plan in plan_buffers(shapes, block_rows, dtype, comm_dtype, unit_mesh.shard_size, cost, quant_block):
                in_buffer = [members[p] for p in plan.positions]
                dbuffer = self._new_dbuffer(
                    [s.local.shape for s in in_buffer],
                    [s.block_rows for s in in_buffer],
                    dtype,
                    members[0].param.device,
                    unit_mesh.shard_group,
                    plan.layout,
                    policy,
                    grad_dtype,
                )
                dbuffer.slot_names = tuple(s.fqn for s in in_buffer)
                buffer = ShardedBuffer(dbuffer, unit_mesh, [], policy, grad_dtype=grad_dtype)
                for slot, spec in enumerate(in_buffer):
                    buffer.params.append(FSDPParam(spec.fqn, spec.owners, buffer, slot, spec.param, spec.parallel))
                buffer.release_unused_shards()
                self.buffers.append(buffer)
                for position, fsdp_param in zip(plan.positions, buffer.params):
                    built[indices[position]] = fsdp_param
        fsdp_params = [p for p in built if p is not None]
        register_sharded_faces(fsdp_params)
        track_slots(self.adopt_assigned, fsdp_params)
        manage_parameters(fsdp_params)
        return fsdp_params

    def _new_dbuffer(
        self,
        shapes: list[torch.Size],
        block_rows: list[int | None],
        dtype: torch.dtype,
        device: torch.device,
        group: Any,
        layout: Any,
        policy: MixedPrecisionPolicy,
        grad_dtype: torch.dtype | None = None,
    ) -> DBuffer:
        floating = dtype.is_floating_point
        offload = self.offload if device.type != "meta" else None  # meta stays meta until to_empty
        # Quantized collectives: the policy's block where it quantizes them (floating point only).
        comm = self.comm_policy if floating else None
        dbuffer = DBuffer(
            shapes,
            block_rows,
            dtype,
            device if offload is None else _compute_device(self.mesh),
            group,
            layout,
            param_dtype=policy.param_dtype if floating else None,
            reduce_dtype=default_reduce_dtype(policy.reduce_dtype, policy.param_dtype, dtype, grad_dtype)
            if floating
            else None,
            grad_dtype=grad_dtype,
            offload_to_cpu=offload is not None,
            pin_memory=offload is not None and offload.pin_memory,
            weight_quant_block=comm.block if comm is not None and comm.weights is not None else None,
            grad_quant_block=comm.block if comm is not None and comm.grads is not None else None,
        )
        dbuffer.keep_unsharded_storage = self.keep_unsharded_storage
        return dbuffer

    def set_keep_unsharded_storage(self, keep: bool) -> None:
        """FSDP2 2.15's ``set_keep_unsharded_storage``: resharding keeps the gathered buffers'
        memory, so the unsharded parameters keep their addresses (CUDA graph capture)."""
        self.keep_unsharded_storage = keep
        for dbuffer in self.dbuffers:
            dbuffer.keep_unsharded_storage = keep

    @property
    def dbuffers(self) -> list[DBuffer]:
        return [b.dbuffer for b in self.buffers]

    def readopt_sharded_params(self) -> None:
        """After ``to_empty``/``_apply`` replaced local tensors: move them back into DBuffers
        (new ones in the new device or dtype, over the same layout)."""
        for buffer in self.buffers:
            members = buffer.params
            if all(p.holds_its_view() for p in members):
                continue
            old = buffer.dbuffer
            locals_ = [p.sharded._local_tensor for p in members]
            device = locals_[0].device if locals_ else old.sharded_device
            dtype = locals_[0].dtype if locals_ else old.dtype
            if self.offload is not None and device.type not in ("cpu", "meta"):
                raise RuntimeError(
                    "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
                    'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
                    f"Found following parameters on non-CPU device: {[(p.fqn, device) for p in members]}"
                )
            if device != old.sharded_device or dtype != old.dtype or old.sharded.device.type == "meta":
                # Mixed-precision dtypes follow a dtype change unless the policy fixed them.
                self._rebuild_dbuffer(buffer, dtype, device)
            for fsdp_param, old_local in zip(members, locals_):
                fsdp_param.readopt_local(old_local)
            buffer.release_unused_shards()

    def _rebuild_dbuffer(self, buffer: ShardedBuffer, dtype: torch.dtype, device: torch.device) -> None:
        """Give ``buffer`` a new DBuffer in ``dtype`` on ``device`` with the old one's layout
        (a DBuffer never re-plans, so no shard moves) and label."""
        old = buffer.dbuffer
        buffer.dbuffer = self._new_dbuffer(
            [s.shape for s in old.slots],
            [s.block_rows for s in old.slots],
            dtype,
            device,
            old.group,
            old.layout,
            buffer.mp_policy,
            buffer.grad_dtype,
        )
        buffer.dbuffer.label = old.label
        buffer.dbuffer.slot_names = old.slot_names
        buffer.extensions = None  # its input buffers follow the DBuffer's device

    def materialize_empty(self, device: torch.device, within: set[nn.Module]) -> dict[int, torch.Tensor]:
        """``to_empty(device)`` on a meta-built unit: a new DBuffer on ``device`` for each of
        its meta DBuffers whose parameters ``within`` holds, and, by each sharded face's id,
        the DTensor over its view of it that ``_apply`` swaps in instead of an empty copy.

        The shard is allocated once, as FSDP2's ``to_empty`` does: letting ``_apply`` allocate
        each parameter's local tensor and copying it into a new DBuffer afterwards would hold
        two copies at its peak. DBuffers with a parameter that keeps its own local tensor (an
        all-gather extension), or under CPU offload to another device than the host, go the
        general way (:meth:`readopt_sharded_params`)."""
        faces: dict[int, torch.Tensor] = {}
        if self.offload is not None and device.type != "cpu":
            return faces  # refused by readopt_sharded_params, with FSDP2's error
        for buffer in self.buffers:
            old = buffer.dbuffer
            members = buffer.params
            if (
                not members
                or old.sharded.device.type != "meta"
                or any(p.owns_local or p.sharded._local_tensor.device.type != "meta" for p in members)
                or any(module not in within for p in members for module, _ in p.owners)
            ):
                continue
            self._rebuild_dbuffer(buffer, old.dtype, device)
            for fsdp_param in members:
                faces[id(fsdp_param.sharded)] = fsdp_param.face_over_own_view()
        return faces

    def adopt_assigned(self, fsdp_param: FSDPParam, value: nn.Parameter) -> nn.Parameter | None:
        """``module.<name> = value`` on a managed parameter (``load_state_dict(assign=True)``
        too): keep the sharded DTensor in its DBuffer and take ``value``'s data for this rank.

        ``value`` is the full parameter (a plain tensor) or a DTensor of any placement over the
        parameter's mesh (a sharded state dict). Returns the parameter to register.
        """
        if value is fsdp_param.sharded or value is fsdp_param.unsharded:
            return None
        if tuple(value.shape) != tuple(fsdp_param.sharded.shape):
            raise ValueError(
                f"cannot assign a tensor of shape {tuple(value.shape)} to {fsdp_param.fqn!r}, a parameter of "
                f"shape {tuple(fsdp_param.sharded.shape)} sharded by fully_shard; assign a tensor of the same shape"
            )
        if self.is_unsharded or self._pending_unshard:
            self.reshard()
        if value.device.type == "meta":
            return fsdp_param.sharded
        if fsdp_param.dbuffer.sharded.device.type == "meta":
            # Assigned over a meta-initialised unit: its buffer moves to the value's device
            # (what to_empty would do); the other parameters wait for their own values.
            for member in fsdp_param.buffer.params:
                member.replace_sharded(value.device)
            self.readopt_sharded_params()
        fsdp_param.write_local(fsdp_param.local_value_of(value))
        return fsdp_param.sharded

    def _register_state_dict_hooks(self) -> None:
        """``state_dict()`` hands out the sharded parameters whatever the unit's state;
        ``state_dict()`` and ``load_state_dict()`` reshard first (as FSDP2) only on a thread
        that trains the modules (another one sees and writes the sharded faces anyway:
        :class:`~vescale_plugins.runtime.param.ManagedParameters`)."""
        slots: dict[int, tuple[nn.Module, list[tuple[str, FSDPParam]]]] = {}
        for fsdp_param in self.fsdp_params:
            for module, name in fsdp_param.owners:
                slots.setdefault(id(module), (module, []))[1].append((name, fsdp_param))
        for unit_module in self.modules:  # first in a load: everything under it is checked before a copy
            unit_module._register_load_state_dict_pre_hook(functools.partial(_check_loaded_entries, unit_module))
        for module, names in slots.values():
            module.register_state_dict_pre_hook(lambda *args, **kwargs: self._reshard_for_state_dict())
            module.register_state_dict_post_hook(functools.partial(_sharded_state_dict_entries, names))
            module._register_load_state_dict_pre_hook(lambda *args, **kwargs: self._reshard_for_state_dict())

    def _reshard_for_state_dict(self) -> None:
        """FSDP2 reshards before ``state_dict()`` and ``load_state_dict()``. Only a thread that
        trains the modules may: another one (torchft's quorum thread, building a heal's state
        dict while this unit's forward runs) would swap the sharded parameters in under that
        forward. Such a thread touches nothing; it reads and writes the sharded faces."""
        if is_training_thread():
            self.reshard()

    # -- unshard / reshard ------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        for b in self.buffers:
            if not b.is_unsharded:
                return False
        return True

    @property
    def has_pending_unshard(self) -> bool:
        """Whether an all-gather was issued (``unshard(async_op=True)``, a prefetch) and not
        yet waited for."""
        return bool(self._pending_unshard)

    @property
    def is_root(self) -> bool:
        """Whether this unit is the root of the units it runs with (set at the first forward)."""
        return self.context is not None and self.context.root is self

    @property
    def forward_in_progress(self) -> bool:
        """Whether some but not all of a grouped unit's modules ran this forward."""
        return bool(self._modules_run)

    def clear_partial_forward(self) -> None:
        """Forget which of a grouped unit's modules ran (its forward is over)."""
        self._modules_run.clear()

    def forget_post_backward_nodes(self) -> None:
        """(End of backward) No ``_PostBackward`` node of this iteration is pending any more."""
        self._pending_post_backward = 0
        self.post_backward_nodes = []

    def check_materialized(self, names: dict[int, str] | None = None) -> None:
        """Refuse to gather parameters still on the meta device, with FSDP2's error; ``names``
        maps a sharded parameter's id to its name from the root (FSDP2's), else the unit's."""
        on_meta = [(names or {}).get(id(p.sharded), p.fqn) for p in self.fsdp_params if p.sharded.device.type == "meta"]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )

    def unshard(self, async_op: bool = False) -> None:
        """All-gather every DBuffer in place; with ``async_op`` the caller waits later."""
        if self._pending_unshard or self.is_unsharded:
            return
        mark_training_thread()
        self.check_materialized()
        with outside_functorch():
            self._pending_unshard = [h for b in self.buffers for h in self._all_gather(b, async_op)]

    def _all_gather(self, buffer: ShardedBuffer, async_op: bool) -> list[GatherHandle]:
        """The DBuffer's all-gather, and its extension parameters' through their inputs (the
        DBuffer's own only when some parameter has none)."""
        # has_extension, inline: asked of every parameter at every all-gather, as FSDP2 asks.
        extended = [p for p in buffer.params if hasattr(p.sharded._local_tensor, EXTENSION_HOOK)]
        for p in buffer.params:
            if p.owns_local and p not in extended:
                raise RuntimeError(
                    f"parameter {p.fqn!r} was a {type(p.sharded._local_tensor).__name__} with all-gather extensions "
                    "at fully_shard and has none now: its data is in its local tensor, not in a DBuffer"
                )
        if buffer.extensions is not None:
            buffer.extensions.ran_on = set()
        handles = [buffer.dbuffer.all_gather(async_op=async_op)] if len(extended) < len(buffer.params) else []
        if extended:
            for p in extended:
                check_extension_param(
                    p.fqn,
                    p.sharded._local_tensor,
                    p.dbuffer.slots[p.slot].shape,
                    parallel=p.parallel is not None,
                    own_mesh=buffer.mesh.mesh is not self.mesh,
                    group_size=is_group_size(self.reshard_after_forward),
                )
            if buffer.extensions is None:
                buffer.extensions = ExtensionGather(buffer.dbuffer)
            handles += buffer.extensions.all_gather(extended, buffer.mp_policy, async_op)
        return handles

    def wait_for_unshard(self) -> None:
        """Complete the all-gathers issued; if one fails (a peer died), drop the others
        unwaited and raise its error, naming the unit."""
        pending, self._pending_unshard = self._pending_unshard, []
        with outside_functorch():
            try:
                for work in pending:
                    work.wait()
            except CollectiveError:
                for work in pending:
                    work.abandon()
                raise

    def use_unsharded_params(self) -> None:
        """Gather (if needed) and register the unsharded parameters in the modules."""
        with spmd_no_typecheck():
            self.unshard()
            self.wait_for_unshard()
            made_anew = register_unsharded_faces(self.fsdp_params, self._after_gradient)
        for fsdp_param in made_anew:
            fsdp_param.restore_spmd_types()

    def reshard(self) -> None:
        """Free the unsharded buffers and register the sharded parameters again."""
        self.wait_for_unshard()
        register_sharded_faces(self.fsdp_params)
        for buffer in self.buffers:
            buffer.dbuffer.release_unsharded()
            if buffer.extensions is not None:
                buffer.extensions.release()

    def _reshard_to_post_forward_group(self) -> None:
        """``reshard_after_forward=k``: keep the parameters sharded over groups of k
        consecutive ranks until backward, which gathers within those k ranks only (FSDP2's
        memory and traffic: 1/k of the unit per rank)."""
        self.wait_for_unshard()
        register_sharded_faces(self.fsdp_params)
        k = self.reshard_after_forward
        assert is_group_size(k)  # what complete_forward checked
        for buffer in self.buffers:
            buffer.dbuffer.reshard_to_group(post_forward_group(buffer.mesh.mesh, k))

    # -- forward ----------------------------------------------------------------------

    # pre_forward and post_forward run under the module hooks' eager_hook (runtime/api.py):
    # not wrapped again, as each wrap costs the host a Dynamo context switch per call.
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._recomputing():
            # Activation checkpointing recomputes this forward inside the unit's backward: the
            # backward owns the parameters' state, so only make sure they are unsharded (an
            # earlier post-backward of a unit run twice may have resharded them), as FSDP2.
            self.use_unsharded_params()
            return self._cast_forward_inputs(args, kwargs)
        if self.training_state is TrainingState.POST_BACKWARD:
            # A forward after this unit's own backward (a chunked loss calls the head, runs
            # that chunk's backward, then calls it again): what that backward reduced or
            # accumulated is final; this forward's backward adds to it.
            self._backward_again = True
            self._modules_run.clear()
        if self._modules_run and id(module) not in self._modules_run:
            self._modules_run.add(id(module))
            return self._cast_forward_inputs(args, kwargs)  # every module of a grouped unit
        # A module of a grouped unit run again before the others ran (a head called per chunk
        # of a chunked loss) starts a new forward of the unit, with its own post-backward.
        self._modules_run = {id(module)}
        context = self.context
        assert context is not None  # the root state's pre_forward made it
        if context.root is self:
            if context.reduction_pending is not None:
                raise RuntimeError("The previous gradient reduction must be waited on before forward")
            context.start_forward()
        if torch.is_grad_enabled():
            context.forward_order.append(self)
        self.use_unsharded_params()
        with spmd_no_typecheck():
            for group in self._forward_prefetch_targets(context):
                group.unshard(async_op=True)
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        if torch.is_grad_enabled():
            self.training_state = TrainingState.FORWARD
            args, kwargs = self._attach_post_backward((args, kwargs))
        return args, kwargs

    def _forward_prefetch_targets(self, context: IterationContext[FSDPParamGroup]) -> list[FSDPParamGroup]:
        """The units set by ``set_modules_to_forward_prefetch``, else the unit that ran next
        in the previous training forward.

        On CUDA, FSDP2 overlaps the next all-gather with compute implicitly (the CPU runs
        ahead of the GPU and issues it early); a CPU backend has no run-ahead, so the next
        unit is gathered explicitly. It costs one more unit's parameters during forward.
        """
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = context.previous_forward_order
        if self not in order:
            return []
        position = order.index(self) + 1
        return [order[position]] if position < len(order) and order[position] is not self else []

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``MixedPrecisionPolicy(cast_forward_inputs=True)``: floating-point inputs to
        ``param_dtype``, wherever they are nested (as FSDP2: lists, dicts, dataclasses)."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            return cast_floating(output, self.mp_policy.output_dtype)
        return output

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return self._cast_output(output)  # a recomputation (see pre_forward)
        if len(self._modules_run) < len(self.modules):
            return self._cast_output(output)  # each module of a grouped unit, as FSDP2
        output = self.complete_forward(output)
        context = self.context
        assert context is not None  # set at the first forward (RootState.init_under)
        if context.root is self:
            # Finish the forward of grouped units some of whose modules did not run (a
            # chunked loss calls the head after forward), on the root's output, as FSDP2
            # does: they reshard, and their backward starts with the root's.
            for group in reversed(context.groups):
                if group is not self and group.forward_in_progress:
                    output = group.complete_forward(output)
        return self._cast_output(output)

    def complete_forward(self, output: Any) -> Any:
        """Reshard as the policy says and hook the outputs for the pre-backward."""
        self._modules_run.clear()
        if self._reshards_after_forward():
            with spmd_no_typecheck():
                # is_group_size, inline (an int that is not a bool): once per unit per step
                k = self.reshard_after_forward
                if isinstance(k, int) and not isinstance(k, bool) and torch.is_grad_enabled():
                    self._reshard_to_post_forward_group()
                else:
                    self.reshard()
        if torch.is_grad_enabled():
            assert self.context is not None  # set at the first forward (RootState.init_under)
            self.context.post_forward_order.append(self)
            with spmd_no_typecheck():
                output = register_on_tensors(output, self._pre_backward_hook)
        return output

    def _reshards_after_forward(self) -> bool:
        if not torch.is_grad_enabled():
            return True  # no backward will need the parameters (evaluation, inference)
        if self.reshard_after_forward is None:
            return not self.is_root
        return bool(self.reshard_after_forward)  # a group size k (an int >= 2) reshards

    # -- backward ---------------------------------------------------------------------

    def _attach_post_backward(self, inputs: Any) -> Any:
        tensors = tensors_requiring_grad(inputs)
        if not tensors or torch._C._are_functorch_transforms_active():
            # (under torch.func transforms the final callback reduces the unit instead)
            return inputs
        self._pending_post_backward += 1
        outs = _PostBackward.apply(self, *tensors)
        outs = outs if isinstance(outs, tuple) else (outs,)
        self.post_backward_nodes.append(weakref.ref(outs[0].grad_fn))
        replacements = iter(outs)
        return map_grad_tensors(inputs, lambda t: next(replacements))

    @eager_hook
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        if self.training_state is TrainingState.POST_BACKWARD:
            # Backward reaches another call of a unit that ran more than once in forward
            # after its post-backward (that call's inputs needed no gradient, so nothing
            # held the post-backward back): its backward reads the parameters again. Gather
            # them again and reduce the new gradients at the end of backward, onto the first
            # reduction's, as FSDP2 does.
            self._backward_again = True
        self.training_state = TrainingState.PRE_BACKWARD
        assert self.context is not None  # set at the first forward (RootState.init_under)
        compiled_autograd = in_compiled_autograd()
        self.context.backward_starts()  # the first unit's: the root state queues the end
        if self.unshard_in_backward:
            # Else (FSDP2's set_unshard_in_backward(False)) the unit's backward reads no
            # parameter (an embedding's): its gradients reach the unsharded parameters the
            # forward used, whose storage is not needed.
            self.use_unsharded_params()
        if not compiled_autograd:
            for unsharded, _ in self._gradients_upcast_late():
                defer_upcast(unsharded, self.requires_gradient_sync)
        self._backward_prefetched = False
        if compiled_autograd or not any([p.sharded.requires_grad for p in self.fsdp_params]):
            # Under compiled autograd at FSDP2's place: each eager call splits the compiled
            # backward, and _after_gradient then has nothing eager to do (see there).
            self._prefetch_for_backward_now()

    def _gradients_upcast_late(self) -> list[tuple[nn.Parameter, torch.dtype]]:
        """The unsharded parameters (with their reduce dtype) whose DBuffer follows FSDP2
        2.15's deferred upcast; none before 2.15 or where the dtypes agree."""
        return [
            (p.unsharded, buffer.dbuffer.reduce_dtype)
            for buffer in self.buffers
            if defers_upcast(buffer.dbuffer.param_dtype, buffer.dbuffer.reduce_dtype)
            for p in buffer.params
            if p.unsharded is not None and p.unsharded.requires_grad
        ]

    def _after_gradient(self, param: nn.Parameter) -> None:
        """At the unit's first gradient: start gathering the unit whose backward comes next.

        The previous unit's reduce-scatter goes on overlapping this unit's whole backward; it
        is waited for at this unit's post-backward (FSDP2's place, see ``_reduce_gradients``).

        Not run outside Dynamo as a whole: compiled autograd traces it for every parameter,
        where it only counts (the prefetch was done at the pre-backward), and an eager call
        per parameter would split its graph there.
        """
        if not self._backward_prefetched and self.training_state is not TrainingState.FORWARD:
            self._prefetch_for_backward()  # (FORWARD: see post_backward)
        context = self.context
        assert context is not None  # set at the first forward (RootState.init_under)
        if context.events_to_end is None:  # count_backward_event, inline: once per parameter per step
            context.backward_events += 1
        else:
            context.count_backward_event()

    def prefetches_at_first_gradient(self) -> bool:
        """(In its backward) Whether this unit has still to prefetch its default targets,
        which it does at its first gradient (or its post-backward, if none comes)."""
        return (
            not self._backward_prefetched
            and self.backward_prefetch is None
            and not in_compiled_autograd()
            and any([p.sharded.requires_grad for p in self.fsdp_params])
        )

    def _prefetch_for_backward_now(self) -> None:
        """Start gathering the unit(s) whose backward comes next.

        A unit with gradients does this at its first gradient rather than at its pre-backward
        (where FSDP2 does): the backward ops before that gradient have then released the
        activation gradients they consumed (for an output head, the logits' gradient, often the
        largest tensor of the step), so the prefetched parameters do not add to that moment.

        With host collectives (gloo: no side streams, nothing for a later wait to overlap but
        the backend's own threads), the previous units' reduce-scatters are finished first,
        down to ``reduce_scatter_max_input_buffers - 1`` in flight, so that their unsharded
        gradient buffers are freed before the prefetch allocates. On CUDA they stay in flight
        to this unit's post-backward, FSDP2's place.
        """
        if self._backward_prefetched:
            return
        self._backward_prefetched = True
        context = self.context
        assert context is not None  # set at the first forward (RootState.init_under)
        targets = [group for group in self._backward_prefetch_targets(context) if group.unshard_in_backward]
        if targets:
            context.wait_for_host_reduces(keep=self.reduce_scatter_max_input_buffers - 1)
        for group in targets:
            group.unshard(async_op=True)

    # From a gradient hook, which runs outside any eager hook of ours.
    _prefetch_for_backward = eager_hook(_prefetch_for_backward_now)

    def _backward_prefetch_targets(self, context: IterationContext[FSDPParamGroup]) -> list[FSDPParamGroup]:
        """The units set by ``set_modules_to_backward_prefetch``, else the latest unit to
        finish its forward before this one did whose backward has not started (FSDP2's
        post-forward order: the root gathers the last block during the head's backward).

        None where a unit passed over on the way is in its backward and has yet to prefetch
        that same unit at its first gradient: a root without parameters, whose pre-backward
        runs with the head's on the logits' gradient, leaves the last block to the head, so
        it is not gathered while the logits' gradient is alive (the head's backward frees it
        before the head's first gradient; see ``_prefetch_for_backward``).
        """
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = context.post_forward_order
        if self not in order:
            return []
        position = order.index(self)
        for earlier in reversed(order[:position]):
            if earlier is self:
                continue
            if earlier.training_state is TrainingState.PRE_BACKWARD and earlier.prefetches_at_first_gradient():
                return []
            if earlier.training_state not in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
                return [earlier]
        return []

    def _recomputing(self) -> bool:
        """Whether a forward starting now recomputes one inside the unit's backward."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return True
        return self.training_state is TrainingState.POST_BACKWARD and torch._C._current_graph_task_id() != -1

    @eager_hook
    def post_backward_from_inputs(self, node: Any) -> None:
        """(A ``_PostBackward`` node of this unit ran) Once the backward reaches no other
        forward of the unit, its post-backward."""
        self._pending_post_backward -= 1
        self.post_backward_nodes = [ref for ref in self.post_backward_nodes if ref() not in (None, node)]
        if self.training_state in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD) and self._backward_done():
            self._post_backward_now()
        assert self.context is not None  # set at the first forward (RootState.init_under)
        self.context.count_backward_event()

    def _backward_done(self) -> bool:
        """(At a ``_PostBackward``) Whether the backward running now reaches no other forward
        of this unit: then its gradients are complete for this backward.

        A forward whose backward comes in a later ``backward()`` call (a head called per chunk
        of a chunked loss after the decoder's forward, pipeline micro-batches) is not waited
        for: FSDP2 runs its post-backward at each backward too, so that gradients of no-sync
        backwards are summed in the reduce dtype, not by autograd in the parameter dtype.
        Compiled autograd is asked nothing: it counts on every forward of this backward.
        """
        if self._pending_post_backward <= 0:
            return True
        if in_compiled_autograd():
            return False
        will_run = torch._C._will_engine_execute_node
        return not any(node is not None and will_run(node) for node in (ref() for ref in self.post_backward_nodes))

    def _post_backward_now(self) -> None:
        """Reshard, then reduce-scatter the unit's gradients (unless accumulating without sync).

        Resharding first frees the unsharded parameters before the reduce-scatter allocates.
        """
        if self.training_state not in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD):
            return
        # FORWARD: no pre-backward ran (a grouped unit's partial forward, a head called per
        # chunk): its backward is not the model's, which prefetches when it comes.
        in_models_backward = self.training_state is TrainingState.PRE_BACKWARD
        self.training_state = TrainingState.POST_BACKWARD
        for unsharded, reduce_dtype in self._gradients_upcast_late():
            upcast_gradient(unsharded, reduce_dtype)
        if in_models_backward:
            self._prefetch_for_backward_now()  # if no gradient reached this unit
        if self.reshard_after_backward:
            self.reshard()
        if self.requires_gradient_sync:
            self._reduce_gradients()
            if not in_models_backward and not in_compiled_autograd():
                assert self.context is not None  # set at the first forward (RootState.init_under)
                self.context.finish_reductions_after_this_backward()
        else:
            self._backward_again = False  # nothing reduced: the gradients accumulate as usual
            for fsdp_param in self.fsdp_params:
                fsdp_param.accumulate_in(fsdp_param.dbuffer.reduce_dtype)
            # Under manual finalization, finalize_backward reduces them (sync on by then).
            self.post_backward_pending = bool(self.context is not None and self.context.manual_active)

    post_backward = eager_hook(_post_backward_now)

    def reduce_when_finalized(self) -> None:
        """(``finalize_backward``, manual finalization) The reduction that waited for it."""
        self.reduce_accumulated()

    def reduce_accumulated(self) -> None:
        """Reduce, after its backwards, the gradients the unit accumulated (without sync, or
        waiting for ``finalize_backward``): FSDP2's ``post_backward`` called from outside
        autograd, as ``finalize_backward`` and ``torch.distributed.pipelining``'s reduce-grad
        step call it. Resharding and reducing follow the unit's settings then."""
        self.post_backward_pending = False
        self._backward_prefetched = True  # backward is over: nothing to prefetch
        self.training_state = TrainingState.PRE_BACKWARD
        self.post_backward()

    def _reduce_gradients(self) -> None:
        """Move the unit's gradients into its gradient buffers and reduce-scatter them
        asynchronously (at most ``reduce_scatter_max_input_buffers`` units in flight).

        Called after resharding, as FSDP2 chunk-cats after resharding: the buffer is allocated
        once the unsharded parameters are freed and the oldest reduce-scatters (which
        overlapped this unit's backward) are finished until fewer than the cap remain, as
        FSDP2's post-backward recycles its reduce-scatter inputs: with the default cap of 1,
        the previous unit's gradient buffer and this unit's autograd gradients are what is
        alive. Autograd's gradients are copied in (one copy each: its backward ops always
        write fresh tensors) and freed as they are copied. The root waits for the last
        reduce-scatters, and for what follows each (HSDP's all-reduce, the all-reduce hook),
        at the end of backward.
        """
        context = self.context
        assert context is not None  # set at the first forward (RootState.init_under)
        context.wait_for_reduces(keep=self.reduce_scatter_max_input_buffers - 1)
        if self._backward_again:
            # The unit's second reduction in this backward adds to its first: that one lands
            # first, and the gradients it gave only through other ranks are attached, so
            # that no slot of it counts as empty below.
            self._backward_again = False
            context.wait_for_gradients()
            if context.reduced_without_local_grad:
                context.attach_remote_gradients()
        issued: list[ReduceScatterHandle] = []
        for buffer in self.buffers:
            members = [p for p in buffer.params if p.sharded.requires_grad]
            if not members:
                continue
            dbuffer = buffer.dbuffer
            # Every rank reduces every unit that ran backward, gradients or not (another rank's
            # data may have reached parameters this one's did not): slices no gradient reached
            # are zeroed. The dict holds the only references, so each gradient is freed as it
            # is copied, before the reduce-scatter allocates the sharded gradient.
            grads = take_gradients(members)
            received = [grads[p.slot] is not None for p in members]
            dbuffer.fill_unsharded_grad(grads)
            adopt_assigned_grads(dbuffer, members)
            accumulate = any([p.sharded.grad is not None for p in members])  # a list: no generator per parameter
            if accumulate:
                # Gradients set to None since the last step restart from zero in the buffer.
                for p in members:
                    if p.sharded.grad is None:
                        dbuffer.sharded_grad_view(p.slot).zero_()
            replicate_group = buffer.mesh.replicate_group
            # The mean over every data-parallel rank of the buffer's own mesh by default,
            # scaled where and as FSDP2 scales it.
            reduction = gradient_reduction(
                dbuffer.reduce_dtype,
                buffer.mesh.shard_size,
                buffer.mesh.replicate_size,
                self.gradient_divide_factor,
                self.force_sum_reduction_for_comms,
            )
            if replicate_group is not None and not self.requires_all_reduce:
                # HSDP accumulating without the all-reduce (FSDP2's set_requires_all_reduce):
                # the shard group's reductions wait in a partial buffer; no gradient is attached yet.
                issued.append(_issue_reduce(context, issued, dbuffer, reduction, accumulate=False, partial=True))
                self.reduced_partially = True
                continue
            self.reduced_partially = False  # this all-reduce carries the partial sums too
            after = None
            if replicate_group is not None or self.all_reduce_hook is not None:
                after = AfterReduceScatter(replicate_group, self.all_reduce_hook, self.all_reduce_hook_stream)
            handle = _issue_reduce(context, issued, dbuffer, reduction, accumulate=accumulate, after=after)
            handle.after_wait = functools.partial(_run_post_accumulate_grad_hooks, members)
            issued.append(handle)
            attached = []
            for p, got in zip(members, received):
                if p.sharded.grad is not None:
                    continue
                if got:
                    attached.append(p)
                else:
                    sharded_grad = dbuffer.sharded_grad
                    assert sharded_grad is not None  # the reduce-scatter's handle holds it
                    context.reduced_without_local_grad.append((p, sharded_grad))
            if attached:
                attach_sharded_grads(dbuffer, attached)
            # A reduce-scatter that fails leaves no half-reduced gradient behind: those made
            # views of its buffer here are forgotten (accumulated ones keep their old values).
            handle.on_abandon = functools.partial(_forget_gradients, attached)
        if issued:
            context.reduces_in_flight.append(issued)

    def reset_iteration_state(self) -> None:
        """Forget this iteration (after an exception aborted it): no gradient, no gather (one
        whose group failed is dropped, not waited on)."""
        with contextlib.suppress(CollectiveError):  # raised once its gathers were dropped
            self.wait_for_unshard()
        self.training_state = TrainingState.IDLE
        self._pending_post_backward = 0
        self.post_backward_nodes = []
        self._backward_prefetched = False
        self._backward_again = False
        self.post_backward_pending = self.reduced_partially = False
        self._modules_run.clear()
        for fsdp_param in self.fsdp_params:
            fsdp_param.accumulated_grad = None
            if fsdp_param.unsharded is not None:
                fsdp_param.unsharded.grad = None
        self.reshard()
        for dbuffer in self.dbuffers:
            dbuffer.release_unsharded_grad()


def _compute_device(mesh: DeviceMesh) -> torch.device:
    """The device a CPU-offloaded unit computes on: its mesh's (the current CUDA device)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _issue_reduce(
    context: IterationContext[FSDPParamGroup],
    issued: list[ReduceScatterHandle],
    dbuffer: DBuffer,
    reduction: GradientReduction,
    accumulate: bool,
    after: AfterReduceScatter | None = None,
    partial: bool = False,
) -> ReduceScatterHandle:
    """``dbuffer``'s reduce-scatter, issued asynchronously; if it fails, this unit's
    reductions ``issued`` so far and every one in flight are dropped before its error rises."""
    try:
        return dbuffer.reduce_scatter(reduction, accumulate, async_op=True, after=after, partial=partial)
    except CollectiveError:
        context.abandon_reductions(issued)
        raise


def _forget_gradients(params: list[FSDPParam]) -> None:
    for fsdp_param in params:
        fsdp_param.sharded.grad = None


def _run_post_accumulate_grad_hooks(members: list[FSDPParam]) -> None:
    for fsdp_param in members:
        if getattr(fsdp_param.sharded, "_post_accumulate_grad_hooks", None):  # the usual none, inline
            fsdp_param.run_post_accumulate_grad_hooks()


@register_spmd_local_autograd_function
class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, group: FSDPParamGroup, *inputs: torch.Tensor) -> Any:
        ctx.group = group
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.group.post_backward_from_inputs(ctx)  # ctx is this autograd node
        return (None, *grads)


def _check_loaded_entries(unit_module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A unit module's load pre-hook: refuse an entry that cannot be this rank's value of its
    parameter (a shard taken on another rank, on another mesh), naming the parameter. Every
    managed parameter under the module is checked, so the outermost unit (whose hook torch
    runs first) refuses a bad state dict before any parameter is written or any collective
    runs. A DTensor of other placements on an equal mesh is redistributed, as FSDP2's load
    does (a collective every rank runs alike)."""
    for module_name, module in unit_module.named_modules():
        params = module.__dict__["_parameters"]
        for name, fsdp_param in params.managed.items() if isinstance(params, ManagedParameters) else ():
            key = f"{prefix}{module_name}.{name}" if module_name else prefix + name
            _check_loaded_entry(key, state_dict.get(key), fsdp_param)


def _check_loaded_entry(key: str, value: Any, fsdp_param: FSDPParam) -> None:
    if not isinstance(value, torch.Tensor):
        return
    sharded, problem = fsdp_param.sharded, None
    if tuple(value.shape) != tuple(sharded.shape):
        problem = f"has shape {tuple(value.shape)}, the parameter {tuple(sharded.shape)}"
    elif not isinstance(value, DTensor):
        return  # a full tensor: each rank takes its part
    elif value.device_mesh.shape != sharded.device_mesh.shape:
        problem = f"is sharded over a mesh of shape {tuple(value.device_mesh.shape)}, the parameter over {tuple(sharded.device_mesh.shape)}"
    elif tuple(value.placements) == tuple(sharded.placements):
        local, own = tuple(value._local_tensor.shape), tuple(sharded._local_tensor.shape)
        if local != own:
            problem = (
                f"holds a local shard of shape {local} where this rank's shard under "
                f"{list(sharded.placements)} is {own}: it was taken on another rank"
            )
    if problem is not None:
        raise RuntimeError(
            f"load_state_dict: the state dict's {key!r} {problem}; nothing was loaded. Load on each rank "
            "the state dict that same rank produced (in torchft, the same rank of the healing replica "
            "group), or a full state dict; a checkpoint from another world size loads through "
            "torch.distributed.checkpoint.load"
        )


def _sharded_state_dict_entries(
    names: list[tuple[str, FSDPParam]], module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """A unit's state-dict post-hook: each managed parameter's entry is its sharded DTensor.

    Read from the sharded parameter, never from what the module holds now (the gathered
    parameters during forward and backward, when another thread takes the state dict): so a
    state dict taken from another thread while the unit trains (torchft's quorum thread) is
    the sharded state, whole, and the training thread's parameters stay as they were. Each
    tensor entry is over a storage of exactly its shard's bytes (a view into the unit's
    DBuffer: the same memory, no copy), so consumers that serialise tensors through their
    storages (torchft's ``PGTransport``, ``torch.save`` of one entry) send the shard, not the
    unit's whole buffer; writes into the entry (DCP's in-place load) land in the DBuffer.
    """
    for name, fsdp_param in names:
        key = prefix + name
        value = state_dict.get(key)
        if value is None:
            continue
        if isinstance(value, nn.Parameter):  # state_dict(keep_vars=True): the parameter itself
            state_dict[key] = fsdp_param.sharded
        else:
            state_dict[key] = with_own_bytes(fsdp_param.sharded.detach())

"""``VeScaleFSDPModule``: FSDP2's ``FSDPModule`` methods on every module ``fully_shard``
manages, and the class each managed module becomes (``FSDP<Name>``'s counterpart)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from vescale_plugins.runtime.fsdp2_semantics import TorchGradientReductionHandle
from vescale_plugins.runtime.param_group import FSDPParamGroup
from vescale_plugins.runtime.setup import (
    check_reshard_after_forward,
    normalise_reshard_after_forward,
    refuse_with_parameter_meshes,
)
from vescale_plugins.runtime.state import RootState, groups_under, post_forward, pre_forward, root_state_of

__all__ = ["GradientReductionHandle", "UnshardHandle", "VeScaleFSDPModule", "fsdp_class", "fsdp_state_of", "group_of"]


class UnshardHandle(_TorchUnshardHandle):
    """Returned by ``unshard(async_op=True)``, as FSDP2's: ``wait()`` blocks until the
    all-gather is done and registers the unsharded parameters; waiting is optional (the
    unit's next forward waits for it) and a second ``wait()`` does nothing."""

    def __init__(self, unit: FSDPParamGroup) -> None:
        self._unit: FSDPParamGroup | None = unit

    def wait(self) -> None:
        if self._unit is not None:
            if self._unit.has_pending_unshard:  # not yet waited for (nor resharded) elsewhere
                self._unit.use_unsharded_params()
            self._unit = None  # as FSDP2: keep no reference after waiting


class GradientReductionHandle(TorchGradientReductionHandle):
    """Returned by ``finalize_backward(async_op=True)``, as FSDP2 2.15's: ``wait()`` completes
    the gradient reductions and ends the backward iteration; call it before reading the
    gradients or running the model again. ``reset_iter_state()`` invalidates it."""

    def __init__(self, state: RootState | None = None, token: object | None = None) -> None:
        self._state, self._token = state, token

    def wait(self) -> None:
        state, token = self._state, self._token
        if state is None:
            return
        if state.reduction_pending is not token:
            raise RuntimeError("This gradient reduction handle was invalidated")
        self._state = self._token = None
        state.end_backward_iteration()


class _FSDPStateAdapter:
    """What ``_get_fsdp_state()`` and ``torch.distributed.fsdp.fully_shard.state(module)``
    return for our modules: FSDP2's private state object, as far as torch's own code reaches
    into it. ``register_fsdp_forward_method`` (which transformers' Trainer calls for
    ``generate``) reads its forward hooks; ``torch.distributed.pipelining``'s reduce-grad step
    (``_PipelineStageBase.perform_reduce_grad``) runs every unit's ``post_backward`` through
    ``_state_ctx.all_states[*]._fsdp_param_groups`` and then the root's
    ``_root_post_backward_final_callback``. Anything else raises, naming what to use instead.
    """

    def __init__(self, module: VeScaleFSDPModule) -> None:
        self._module = module

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return pre_forward(group_of(module), module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return post_forward(group_of(module), module, output)

    @property
    def _fsdp_param_groups(self) -> list[_PipelinedUnit]:
        return [_PipelinedUnit(group_of(self._module))]

    @property
    def _state_ctx(self) -> _PipelinedUnits:
        return _PipelinedUnits(groups_under([cast(nn.Module, self._module)]))

    def _root_post_backward_final_callback(self) -> None:
        """End the backward whose reductions pipelining started (FSDP2's final callback, which
        pipelining calls itself: its split backwards run outside ``backward()``)."""
        state = root_state_of(group_of(self._module))
        if state is not None:
            state.final_callback()

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(
            f"FSDP2's private state attribute {name!r} does not exist on a module managed by "
            "vescale_plugins.fully_shard; use the public FSDPModule methods"
        )


class _PipelinedUnit:
    """One unit as pipelining's reduce-grad step sees an FSDP2 parameter group: its
    ``post_backward()`` reduces what the step's no-sync backwards accumulated."""

    def __init__(self, unit: FSDPParamGroup) -> None:
        self.unit = unit

    def post_backward(self) -> None:
        if self.unit.context is not None:  # else it never ran forward: nothing accumulated
            self.unit.reduce_accumulated()


class _PipelinedUnits:
    """The units under a module, as pipelining reads FSDP2's state context: ``all_states``,
    each with its ``_fsdp_param_groups`` (one state per unit here)."""

    def __init__(self, units: list[FSDPParamGroup]) -> None:
        self.units = units

    @property
    def all_states(self) -> list[_UnitState]:
        return [_UnitState(unit) for unit in self.units]


class _UnitState:
    def __init__(self, unit: FSDPParamGroup) -> None:
        self._fsdp_param_groups = [_PipelinedUnit(unit)]
        # Pipelining before torch 2.13 reads a state's one group under the singular name.
        self._fsdp_param_group = self._fsdp_param_groups[0]


def fsdp_state_of(module: nn.Module) -> _FSDPStateAdapter:
    """The state object torch's code reaches for on ``module`` (see ``_FSDPStateAdapter``)."""
    assert isinstance(module, VeScaleFSDPModule)
    return _FSDPStateAdapter(module)


def _refuse_deepcopy(*args: Any, **kwargs: Any) -> Any:
    # FSDP2 raises the same error (an AssertionError) for its modules.
    raise AssertionError(
        "FSDP does not support deepcopy. Please use state dict for serialization "
        "(vescale_plugins.fully_shard manages this module)."
    )


class VeScaleFSDPModule(FSDPModule):
    """Mixed into every module ``fully_shard`` manages: FSDP2's ``FSDPModule`` methods.

    It subclasses torch's ``FSDPModule`` so ``isinstance(m, FSDPModule)`` checks (Accelerate,
    transformers, Lightning, user code) see a managed module; every public method of
    FSDPModule is overridden here, so none of FSDP2's internals run on our modules.
    """

    # FSDPModule.__new__ builds the original class, found at this index of the MRO:
    # [FSDP<Orig>, VeScaleFSDPModule, FSDPModule, Orig, ...].
    _orig_cls_mro_index: int = 3
    _vescale_fsdp_unit: FSDPParamGroup

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (FSDP2 semantics: the next forward reuses them)."""
        unit = self._vescale_fsdp_unit
        if async_op:
            unit.unshard(async_op=True)
            return UnshardHandle(unit)
        unit.use_unsharded_params()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters; the sharded ones are registered again."""
        self._vescale_fsdp_unit.reshard()

    def set_custom_all_gather(self, comm: Any) -> None:
        raise NotImplementedError(
            "set_custom_all_gather: veScale-FSDP all-gathers its DBuffers in place and takes no "
            "custom all-gather; use torch.distributed.fsdp.fully_shard for custom collectives"
        )

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise NotImplementedError(
            "set_custom_reduce_scatter: veScale-FSDP reduce-scatters its gradient DBuffers itself "
            "and takes no custom reduce-scatter; use torch.distributed.fsdp.fully_shard for that"
        )

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """As FSDP2: ``hook(reduce_output)`` runs on this unit's reduce output (after HSDP's
        all-reduce across replicas), in place, before it lands in the sharded gradients, on
        the all-reduce stream, or on ``stream`` (only without HSDP). It sees the mean, or the
        sum under ``set_force_sum_reduction_for_comms(True)`` and for fp16 reductions (fp16's
        sum pre-divided by a power of two; divided after it)."""
        unit = self._vescale_fsdp_unit
        if len({id(buffer.mesh.mesh) for buffer in unit.buffers}) > 1:
            raise ValueError(
                "set_all_reduce_hook is not supported with multiple param groups (from per-param "
                "mesh via shard_placement_fn). The hook would be ambiguous across groups with "
                "different meshes."
            )
        if stream is not None and any(buffer.mesh.replicate_group is not None for buffer in unit.buffers):
            raise ValueError("stream cannot be set when using native HSDP")
        unit.all_reduce_hook = hook
        if stream is not None:
            unit.all_reduce_hook_stream = stream

    def set_post_optim_event(self, event: torch.Event) -> None:
        """As FSDP2: the next all-gather waits for ``event`` on its stream instead of for the
        compute stream (no host sync, no false dependency on work after the step)."""
        units = groups_under([cast(nn.Module, self)])
        streams = {id(d.streams): d.streams for group in units for d in group.dbuffers}
        for comm_streams in streams.values():
            comm_streams.wait_before_next_all_gather(event)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2: use :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """As FSDP2: the collectives sum (no ``AVG`` or ``PREMUL_SUM``) and the sum is divided
        after them; this unit's all-reduce hook then sees the sum instead of the mean."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {enable!r}")
        self._vescale_fsdp_unit.force_sum_reduction_for_comms = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Already so: every unit that ran backward reduce-scatters all its parameters, with
        zeros where no gradient arrived, so the collectives always match across ranks."""
        if not isinstance(reduce_scatter_unused_params, bool):
            raise TypeError(f"reduce_scatter_unused_params must be a bool, got {reduce_scatter_unused_params!r}")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """As FSDP2: how many units' reduce-scatters (and their gradient buffers) may be in
        flight at once; a unit's post-backward waits for the oldest until fewer remain. 1 (the
        default) bounds memory; more hides an exposed reduce-scatter at the cost of buffers."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for unit in self._units(recurse):
            unit.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        if enable:
            raise NotImplementedError(
                "set_separate_reduce_scatter_group(True): veScale-FSDP issues reduce-scatters on "
                "the unit's own process group; leave it off"
            )

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """As FSDP2: with ``False`` backward neither prefetches nor gathers this unit, for a
        unit whose backward reads no parameter (an embedding); its gradients are the same."""
        if not isinstance(unshard_in_backward, bool):
            raise TypeError(f"unshard_in_backward must be a bool, got {unshard_in_backward!r}")
        self._vescale_fsdp_unit.unshard_in_backward = unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        if enable:
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): veScale-FSDP communicates "
                "from its persistent DBuffers, not process-group staging buffers; leave it off"
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError(
            "set_symm_mem_for_comm: symmetric-memory all-gathers are not supported by "
            "vescale_plugins.fully_shard; use torch.distributed.fsdp.fully_shard for them"
        )

    def _get_fsdp_state(self) -> _FSDPStateAdapter:  # type: ignore[override]  # FSDP2 private FSDPState; the adapter has the hooks torch reads
        return _FSDPStateAdapter(self)

    def _units(self, recurse: bool) -> list[FSDPParamGroup]:
        # Mixed into nn.Module subclasses only (fsdp_class), as torch's FSDPModule, which casts so too.
        return groups_under([cast(nn.Module, self)]) if recurse else [self._vescale_fsdp_unit]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With ``False``, backward accumulates full gradients locally and communicates nothing."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        check_reshard_after_forward(reshard_after_forward)
        for unit in self._units(recurse):
            if len({b.mesh.mesh for b in unit.buffers}) > 1:
                refuse_with_parameter_meshes(unit.fsdp_params[0].fqn, reshard_after_forward)
            unit.reshard_after_forward = normalise_reshard_after_forward(reshard_after_forward, unit.mesh)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these units' all-gathers when this unit's forward starts (default: the unit
        that ran after it in the previous forward; ``[]`` for none)."""
        self._vescale_fsdp_unit.forward_prefetch = [group_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these units' all-gathers during this unit's backward, once its first gradient
        has landed (default: the unit that ran before it in forward)."""
        self._vescale_fsdp_unit.backward_prefetch = [group_of(m) for m in modules]

    def set_find_unused_parameters(self, enabled: bool) -> None:
        """Accepted for code written for DDP (``find_unused_parameters``); nothing to switch.

        veScale-FSDP always handles parameters that get gradients on some ranks only
        (data-dependent routing: mixture-of-experts layers, conditional branches): each
        reduce-scatter carries a presence flag per parameter, so such a parameter gets the
        other ranks' reduced gradient on every rank, and one no rank's batch reached keeps
        ``grad=None`` everywhere, as under DDP, with no extra collective.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_find_unused_parameters expects a bool, got {enabled!r}")

    def reset_iter_state(self) -> None:
        """After catching an exception from ``forward()`` or ``backward()``, call this on the
        root module, then run the next iteration normally (FSDP2's recovery workflow): every
        collective in flight is finished, every unit resharded, and the aborted iteration's
        gradients and no-sync accumulation are dropped."""
        group = self._vescale_fsdp_unit
        state = root_state_of(group)
        if state is None:  # never ran forward: nothing under a root yet
            for unit in groups_under([cast(nn.Module, self)]):
                unit.reset_iteration_state()
            return
        if state.root is not group:
            raise RuntimeError(
                "reset_iter_state() must be called on the root module (the one fully_shard was "
                "applied to last, which runs forward first), not on a unit inside it"
            )
        state.reset_iteration()

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with ``False``, backward reduce-scatters within the shard group but does not
        all-reduce across replicas; the sums wait (no gradient is attached) until a backward
        with ``True`` all-reduces them with its own, as FSDP2. No effect on a 1-D mesh."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"requires_all_reduce must be a bool, got {requires_all_reduce!r}")
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """(FSDP2 2.15) With ``True``, set on the root before forward: backward leaves the
        last gradient reductions in flight and the units it left gathered as they are, and
        :meth:`finalize_backward` completes them (call it before reading gradients)."""
        unit = self._vescale_fsdp_unit
        state = root_state_of(unit)
        if state is not None and state.root is not unit:
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        if enabled != unit.manual_backward_finalization and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        if state is not None and state.manual_active is not None and enabled != state.manual_active:
            raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts")
        unit.manual_backward_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """(FSDP2 2.15) Under manual finalization, after every backward of the step: reduce
        what backward left, wait for every reduction (or return a handle to wait on with
        ``async_op=True``) and reshard as ``reshard_after_backward`` says. A no-op before the
        first forward."""
        unit = self._vescale_fsdp_unit
        state = root_state_of(unit)
        if state is None:
            return GradientReductionHandle() if async_op else None
        if state.reduction_pending is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before finalizing backward again")
        if state.root is not unit:
            raise RuntimeError("finalize_backward must be called on the root FSDP module")
        manual = state.manual_active if state.manual_active is not None else unit.manual_backward_finalization
        if not manual:
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if state.callback_queued:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")
        for group in state.groups:
            if group.reduced_partially:
                raise RuntimeError(
                    "FSDP manual backward finalization does not support partial gradient reductions for parameter "
                    f"group {state.label_of(group)!r}. Use automatic backward finalization for this configuration"
                )
        for group in state.groups:
            hsdp = any(b.mesh.replicate_group is not None for b in group.buffers)
            if group.post_backward_pending and hsdp and not group.requires_all_reduce:
                name = state.label_of(group)
                raise RuntimeError(
                    f"FSDP manual backward finalization requires all-reduce for parameter group {name!r}. "
                    "Call set_requires_all_reduce(True) before finalization"
                )
        token = state.finalize_backward(wait=not async_op)
        return GradientReductionHandle(state, token) if async_op else None

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """(FSDP2 2.15) With ``True``, resharding keeps the gathered parameters' memory, so
        their addresses stay the same across reshard and unshard (CUDA graph capture), at
        the cost of that memory."""
        for unit in self._units(recurse):
            unit.set_keep_unsharded_storage(keep)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (FSDP2's meaning): with ``False``,
        the end of backward leaves the gradient reductions it started in flight (a later
        backward, or the last one, waits for them), for microbatching; gradients are final
        after a backward with ``True`` (the default)."""
        for unit in self._units(True):
            unit.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of the group size (this
        unit only, not the units below it, as FSDP2)."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        self._vescale_fsdp_unit.gradient_divide_factor = float(factor)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # to_empty / to(device) replace local tensors; move them back into the DBuffers.
        # to_empty of a meta-built unit allocates its DBuffers first and swaps their views in
        # (one copy of the shard at the peak, as FSDP2). Past FSDPModule: its _apply reads
        # FSDP2's private state.
        unit = self._vescale_fsdp_unit
        device = _to_empty_device(fn)
        if device is not None:
            faces = unit.materialize_empty(device, set(cast(nn.Module, self).modules()))
            if faces:
                fn = _SwapInFaces(faces, fn)
        result = super(FSDPModule, self)._apply(fn, *args, **kwargs)  # type: ignore[misc]  # mypy cannot see the module class after FSDPModule in the MRO
        unit.readopt_sharded_params()
        return result


class _SwapInFaces:
    """``to_empty``'s function, except for the sharded faces given a view of their new
    DBuffer: those get it (by the face's id) instead of a freshly allocated empty tensor."""

    def __init__(self, faces: dict[int, torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.faces, self.fn = faces, fn

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        face = self.faces.pop(id(tensor), None)
        return self.fn(tensor) if face is None else face


def _to_empty_device(fn: Any) -> torch.device | None:
    """The device of ``nn.Module.to_empty``'s function (``torch.empty_like(t, device=...)``,
    which allocates without reading its input), else ``None``; also through another unit's
    :class:`_SwapInFaces` (nested units)."""
    inner = fn
    while isinstance(inner, _SwapInFaces):
        inner = inner.fn
    if getattr(inner, "__qualname__", None) != "Module.to_empty.<locals>.<lambda>":
        return None
    probe = inner(torch.empty(0, device="meta"))
    return None if probe.device.type == "meta" else probe.device


_CLASS_CACHE: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """The class a managed ``cls`` module becomes: ``FSDP<cls>``, FSDP2's name (code matches on
    it), with :class:`VeScaleFSDPModule` in place of FSDP2's ``FSDPModule``."""
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (VeScaleFSDPModule, cls), {"__deepcopy__": _refuse_deepcopy})
    return _CLASS_CACHE[cls]


def group_of(module: Any) -> FSDPParamGroup:
    unit = vars(module).get("_vescale_fsdp_unit")
    if unit is None:
        raise ValueError(f"{type(module).__name__} is not managed by vescale_plugins.fully_shard")
    return unit

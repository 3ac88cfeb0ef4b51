"""``vescale_plugins.fully_shard``: FSDP2's API over RaggedShard parameters and DBuffers.

Same names, arguments and semantics as ``torch.distributed.fsdp.fully_shard`` wherever FSDP2
has them; ``block_size_fn`` is ours. Everything is validated before the module is touched
and before any collective runs, so bad input leaves the module as it was.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from vescale_plugins.runtime import validation
from vescale_plugins.runtime.fsdp_unit import FSDPUnit, _iter_units
from vescale_plugins.runtime.tensor_parallel import SpmdMesh, parallel_spec_for, resolve_dp_mesh_dims

try:  # torch >= 2.13: shard_placement_fn may also answer a placement with a mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:
    ShardPlacementResult = ()  # isinstance(x, ()) is always False

__all__ = ["fully_shard", "VeScaleFSDPModule", "UnshardHandle", "register_fsdp_forward_method"]

BlockSizeFn = Callable[[str, nn.Parameter], "int | None"]


class UnshardHandle(_TorchUnshardHandle):
    """Returned by ``unshard(async_op=True)``, as FSDP2's: ``wait()`` blocks until the
    all-gather is done and registers the unsharded parameters; waiting is optional (the
    unit's next forward waits for it) and a second ``wait()`` does nothing."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit: FSDPUnit | None = unit

    def wait(self) -> None:
        if self._unit is not None:
            if self._unit._pending_unshard:  # not yet waited for (nor resharded) elsewhere
                self._unit.use_unsharded_params()
            self._unit = None  # as FSDP2: keep no reference after waiting


class _FSDPStateAdapter:
    """What ``_get_fsdp_state()`` returns for our modules: FSDP2's private state object is
    reached by torch's own helpers (``torch.distributed.fsdp.register_fsdp_forward_method``,
    which transformers' Trainer calls for ``generate``); its forward hooks are provided,
    anything else raises naming what to use instead."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _unit_of(module).pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _unit_of(module).post_forward(module, output)

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(
            f"FSDP2's private state attribute {name!r} does not exist on a module managed by "
            "vescale_plugins.fully_shard; use the public FSDPModule methods"
        )


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
    # [VeScaleFSDP<Orig>, VeScaleFSDPModule, FSDPModule, Orig, ...].
    _orig_cls_mro_index: int = 3
    _vescale_fsdp_unit: FSDPUnit

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
        raise NotImplementedError(
            "set_all_reduce_hook is not supported by vescale_plugins.fully_shard yet; reduce the "
            "sharded gradients (param.grad) after backward instead"
        )

    def set_post_optim_event(self, event: torch.Event) -> None:
        """FSDP2 makes the next all-gathers wait for ``event``; ours waits for it here (on the
        host), which orders them after the optimizer step just the same."""
        event.synchronize()

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2: use :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Already so: veScale-FSDP always reduces with SUM and divides once afterwards."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {enable!r}")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Already so: every unit that ran backward reduce-scatters all its parameters, with
        zeros where no gradient arrived, so the collectives always match across ranks."""
        if not isinstance(reduce_scatter_unused_params, bool):
            raise TypeError(f"reduce_scatter_unused_params must be a bool, got {reduce_scatter_unused_params!r}")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Validated as FSDP2 does; veScale-FSDP keeps one reduce-scatter in flight (FSDP2's
        default, 1), so only 1 is accepted."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        if max_input_buffers > 1:
            raise NotImplementedError(
                f"set_reduce_scatter_max_input_buffers({max_input_buffers}): veScale-FSDP keeps one "
                "reduce-scatter in flight; use 1 (the default)"
            )

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        if enable:
            raise NotImplementedError(
                "set_separate_reduce_scatter_group(True): veScale-FSDP issues reduce-scatters on "
                "the unit's own process group; leave it off"
            )

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """A memory hint in FSDP2 (skip the backward all-gather of a unit whose parameters
        backward does not read, e.g. an embedding). veScale-FSDP gathers anyway, which gives
        the same gradients; the value is validated and kept."""
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

    def _get_fsdp_state(self) -> _FSDPStateAdapter:
        return _FSDPStateAdapter(self)  # type: ignore[arg-type]

    def _units(self, recurse: bool) -> list[FSDPUnit]:
        return _iter_units([self]) if recurse else [self._vescale_fsdp_unit]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With ``False``, backward accumulates full gradients locally and communicates nothing."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        _check_reshard_after_forward(reshard_after_forward)
        for unit in self._units(recurse):
            if len({m.mesh for m in unit.buffer_meshes}) > 1:
                _refuse_with_parameter_meshes({unit.managed[0].fqn: None}, reshard_after_forward, None)
            unit.reshard_after_forward = _normalise_reshard_after_forward(reshard_after_forward, unit.mesh)

    def set_modules_to_forward_prefetch(self, modules: list["VeScaleFSDPModule"]) -> None:
        """Start these units' all-gathers when this unit's forward starts (default: the unit
        that ran after it in the previous forward; ``[]`` for none)."""
        self._vescale_fsdp_unit.forward_prefetch = [_unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["VeScaleFSDPModule"]) -> None:
        """Start these units' all-gathers during this unit's backward, once its first gradient
        has landed (default: the unit that ran before it in forward)."""
        self._vescale_fsdp_unit.backward_prefetch = [_unit_of(m) for m in modules]

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
        self._vescale_fsdp_unit.reset_iteration()

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with ``False``, backward reduce-scatters within the shard group but does not
        all-reduce across replicas; the sums wait (no gradient is attached) until a backward
        with ``True`` all-reduces them with its own, as FSDP2. No effect on a 1-D mesh."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"requires_all_reduce must be a bool, got {requires_all_reduce!r}")
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
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
        # Past FSDPModule: its _apply reads FSDP2's private state.
        result = super(FSDPModule, self)._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self._vescale_fsdp_unit.readopt_sharded_params()
        return result


_CLASS_CACHE: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"VeScaleFSDP{cls.__name__}", (VeScaleFSDPModule, cls), {"__deepcopy__": _refuse_deepcopy})
    return _CLASS_CACHE[cls]


def _unit_of(module: Any) -> FSDPUnit:
    unit = getattr(module, "_vescale_fsdp_unit", None)
    if unit is None:
        raise ValueError(f"{type(module).__name__} is not managed by vescale_plugins.fully_shard")
    return unit


def _check_reshard_after_forward(value: Any) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"reshard_after_forward={value}: an int must be a positive number of ranks")
        return
    raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def _normalise_reshard_after_forward(value: bool | int | None, mesh: DeviceMesh) -> bool | int | None:
    """An int is the size of the groups parameters stay sharded over after forward: it must
    divide the shard dim's size; 1 means False and the full size True, as in FSDP2."""
    if isinstance(value, bool) or value is None:
        return value
    shard_size = mesh.size(mesh.ndim - 1)
    if shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group's size ({shard_size}); "
            f"use one of {[d for d in range(1, shard_size + 1) if shard_size % d == 0]}"
        )
    return False if value == 1 else True if value == shard_size else value


def _resolve_mesh(mesh: DeviceMesh | None, device: torch.device) -> DeviceMesh:
    if mesh is None:
        if not torch.distributed.is_initialized():
            raise RuntimeError("fully_shard needs an initialised process group or an explicit mesh")
        device_type = "cuda" if device.type == "cuda" else "cpu"
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    validation.check_mesh(mesh)
    if mesh.ndim > 2:
        raise NotImplementedError(
            f"fully_shard got a {mesh.ndim}-D mesh: pass a 1-D mesh (shard) or a 2-D one "
            "(replicate, shard) for hybrid sharding; with tensor or expert parallelism pass the "
            "data-parallel submesh (parameters are DTensors on the other dims), or the full mesh "
            "with dp_mesh_dims"
        )
    return mesh


def _resolve_spmd_mesh(mesh: DeviceMesh | None, dp_mesh_dims: Any, reshard_after_forward: Any, device: torch.device) -> tuple[DeviceMesh | None, SpmdMesh | None]:
    """With ``dp_mesh_dims``, ``mesh`` is the full SPMD mesh: validated as FSDP2 does, and
    replaced by its data-parallel shard dim."""
    if dp_mesh_dims is None:
        return mesh, None
    if not (hasattr(dp_mesh_dims, "shard") and hasattr(dp_mesh_dims, "replicate")):
        raise TypeError(f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, got {dp_mesh_dims!r}")
    full_mesh = _resolve_mesh(mesh, device) if mesh is None else mesh
    validation.check_mesh(full_mesh)
    return resolve_dp_mesh_dims(full_mesh, dp_mesh_dims, reshard_after_forward)


def _collect_params(
    modules: list[nn.Module], ignored: set[nn.Parameter]
) -> tuple[list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]], list[str]]:
    """This unit's parameters: those under ``modules`` not already managed by a child unit."""
    managed_below: dict[int, str] = {}
    for root in modules:
        for sub in root.modules():
            unit = getattr(sub, "_vescale_fsdp_unit", None)
            if unit is not None:
                for m in unit.managed:
                    managed_below[id(m.sharded)] = m.fqn
                    original = m.original() if m.original is not None else None
                    if original is not None:
                        managed_below[id(original)] = m.fqn
    found: dict[int, tuple[str, list[tuple[nn.Module, str]], nn.Parameter]] = {}
    shared_with_child: list[str] = []
    for root in modules:
        for module_name, module in root.named_modules(remove_duplicate=False):
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                fqn = f"{module_name}.{name}" if module_name else name
                if id(param) in managed_below:
                    if not _under_managing_unit(root, module_name):
                        shared_with_child.append(f"{fqn!r} (managed as {managed_below[id(param)]!r})")
                    continue
                entry = found.setdefault(id(param), (fqn, [], param))
                if (module, name) not in entry[1]:
                    entry[1].append((module, name))
    return list(found.values()), shared_with_child


# Every parameter a fully_shard call replaced, held weakly, with where it went: a module
# outside that unit still holding one (a weight tied across sibling units) would otherwise be
# sharded a second time into a separate, silently untied copy.
_SHARDED_BY_ANOTHER_CALL: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _refuse_parameters_of_sibling_units(modules: list[nn.Module], params: list[tuple[str, Any, nn.Parameter]]) -> None:
    for fqn, owners, param in params:
        managed_as = _SHARDED_BY_ANOTHER_CALL.get(param)
        if managed_as is not None:
            here = " + ".join(type(m).__name__ for m in modules)
            raise ValueError(
                f"parameter {fqn!r} of the {here} module is shared with {managed_as}, which "
                "another fully_shard call already sharded; a shared (tied) parameter must belong "
                "to one unit: put both modules in one call, fully_shard([module_a, module_b]), "
                "or shard a module that contains both"
            )


def _under_managing_unit(root: nn.Module, module_name: str) -> bool:
    """Whether the module at ``module_name`` sits inside a unit (so its params are that unit's)."""
    module = root
    for part in module_name.split(".") if module_name else []:
        module = getattr(module, part)
        if getattr(module, "_vescale_fsdp_unit", None) is not None:
            return True
    return False


def _block_rows(fqn: str, param: nn.Parameter, block_size_fn: BlockSizeFn | None) -> int:
    rows = block_size_fn(fqn, param) if block_size_fn is not None else None
    if rows is None:
        return 1
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"block_size_fn({fqn!r}) returned {rows!r}; it must return None or a positive int (rows)")
    return rows


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    block_size_fn: BlockSizeFn | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters as one unit, like ``torch.distributed.fsdp.fully_shard``.

    Parameters become ``nn.Parameter(DTensor)`` with a :class:`RaggedShard` placement whose
    local tensor is a view of the unit's sharded DBuffer, laid out by the planner so that no
    block of ``block_size_fn(name, param)`` rows (default one row) straddles two ranks.
    Blocks are counted from row 0 and need not divide the rows (1031 rows in blocks of 32:
    32 blocks of 32 rows and a last one of 7); ``vescale_plugins.optim.tile_rows(32)`` asks
    for the 32x32 tiles of block-wise 8-bit optimizers.
    Apply it to each block first, then to the root, as with FSDP2. Returns ``module``.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _validate(modules, reshard_after_forward, offload_policy)
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    mesh, spmd = _resolve_spmd_mesh(mesh, dp_mesh_dims, reshard_after_forward, device)
    mesh = _resolve_mesh(mesh, device)
    ignored = set(ignored_params or ())

    def plan() -> list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter, int, Any, DeviceMesh | None]]:
        params, shared = _collect_params(modules, ignored)
        validation.check_not_already_sharded(modules[0], [(fqn, p) for fqn, _, p in params])
        # Parameters shard_placement_fn puts on another mesh than the unit's (FSDP2's
        # ShardPlacementResult: experts over the expert-data-parallel mesh).
        own_mesh = _check_shard_placements(params, shard_placement_fn, mesh, device) if shard_placement_fn is not None else {}
        if own_mesh:
            _refuse_with_parameter_meshes(own_mesh, reshard_after_forward, spmd)
        specs = [parallel_spec_for(fqn, p, own_mesh.get(fqn, mesh), spmd) for fqn, _, p in params]
        if shared:
            raise ValueError(
                "parameters shared between this unit and a unit inside it: " + ", ".join(shared)
                + "; shared (e.g. tied) parameters must belong to one unit: apply fully_shard to a "
                "module that contains every user of them"
            )
        _refuse_parameters_of_sibling_units(modules, params)
        _refuse_tensor_extensions(params)
        return [(fqn, owners, p, _block_rows(fqn, p, block_size_fn), spec, own_mesh.get(fqn)) for (fqn, owners, p), spec in zip(params, specs)]

    # Ranks that plan differently (or fail on some ranks only) all raise here, before any
    # collective. Tensor-parallel parameters are planned by their local (TP) shape.
    with_blocks = validation.agree_on_plan(
        # A parameter on its own mesh is compared by its global shape: the unit's group may
        # span its expert-parallel ranks, whose local shapes differ where experts split unevenly.
        plan, lambda entries: [(fqn, tuple(_local_shape(p) if own is None else p.shape), str(p.dtype), rows) for fqn, _, p, rows, _, own in entries],
        mesh.get_group(mesh.ndim - 1),
    )
    reshard_after_forward = _normalise_reshard_after_forward(reshard_after_forward, mesh)
    unit = FSDPUnit(modules, with_blocks, mesh, reshard_after_forward, mp_policy)
    unit.register_state_dict_hooks()
    where = " + ".join(type(m).__name__ for m in modules)
    for fqn, _, param, _, _, _ in with_blocks:
        _SHARDED_BY_ANOTHER_CALL[param] = f"{fqn!r} of the {where} unit"
    for m in modules:
        m._vescale_fsdp_unit = unit
        m.__class__ = _fsdp_class(type(m))
        m.register_forward_pre_hook(_pre_forward_hook, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward_hook, prepend=False)
    return module


_TENSOR_EXTENSION_HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def _refuse_tensor_extensions(params: list[tuple[str, Any, nn.Parameter]]) -> None:
    """FSDP2's tensor-subclass all-gather extensions (e.g. float8 all-gather) would be
    ignored by our DBuffer all-gather, silently changing what is communicated: refuse."""
    for fqn, _, param in params:
        hooks = [h for h in _TENSOR_EXTENSION_HOOKS if hasattr(param, h)]
        if hooks:
            raise NotImplementedError(
                f"parameter {fqn!r} is a {type(param).__name__} with FSDP2 all-gather extensions "
                f"({', '.join(hooks)}); vescale_plugins.fully_shard does not run them. Use "
                "torch.distributed.fsdp.fully_shard for this model, or keep the parameter a plain "
                "tensor (e.g. float8 training without float8 all-gather)"
            )


def _validate(modules: list[nn.Module], reshard_after_forward: Any, offload_policy: Any) -> None:
    _check_reshard_after_forward(reshard_after_forward)
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(f"offload_policy={offload_policy!r}: CPU offload is not supported yet")
    for m in modules:
        if getattr(m, "_vescale_fsdp_unit", None) is not None:
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}; apply it once per module")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward (got a "
                f"{type(m).__name__}): no hook would ever gather its parameters; shard each of its "
                "blocks, or pass them as a list"
            )


def _local_shape(param: torch.Tensor) -> torch.Size:
    """What the planner lays out: a tensor-parallel parameter's local tensor."""
    return param._local_tensor.shape if isinstance(param, DTensor) else param.shape


def _check_shard_placements(params: list[tuple[str, Any, nn.Parameter]], shard_placement_fn: Callable[[nn.Parameter], Any], mesh: DeviceMesh, device: torch.device) -> dict[str, DeviceMesh]:
    """FSDP2's ``shard_placement_fn``, checked as FSDP2 checks it, on every rank before any
    collective; returns the parameters it puts on another mesh than the unit's.

    ``None`` and ``Shard(0)`` are what veScale-FSDP does. ``Shard(d)`` for another dim
    (torchtitan asks it for experts with fewer rows than ranks) is accepted and trains the
    same parameters: the planner already splits tensors with fewer rows than ranks without
    FSDP2's padding, so the parameter keeps whole rows of dim 0 per rank (placement
    ``RaggedShard``, not ``Shard(d)``), and a one-time warning says so. A
    ``ShardPlacementResult`` may also name another mesh for the parameter (torch >= 2.12;
    torchtitan's experts over the expert-data-parallel mesh): its own DBuffers shard over it.
    """
    other_dims, own_mesh = [], {}
    for fqn, _, param in params:
        placement = shard_placement_fn(param)
        if isinstance(placement, ShardPlacementResult):
            param_mesh = _parameter_mesh(fqn, placement.mesh_info, device)
            if param_mesh != mesh:
                own_mesh[fqn] = param_mesh
            placement = placement.placement
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"Invalid shard_placement_fn result for {fqn!r}: {placement!r}; return a Shard or None (as FSDP2 requires)")
        dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
        if not 0 <= dim < max(param.dim(), 1):
            raise ValueError(f"shard_placement_fn returned {placement!r} for {fqn!r}: Shard dim {placement.dim} is invalid for {param.dim()}D tensor: {tuple(param.shape)}")
        if dim != 0:
            other_dims.append(f"{fqn!r} ({placement!r})")
    if other_dims and not _SHARD_DIM_WARNED:
        _SHARD_DIM_WARNED.append(True)
        more = f" and {len(other_dims) - 1} more" if len(other_dims) > 1 else ""
        warnings.warn(
            f"shard_placement_fn asked for another dim than 0 for {other_dims[0]}{more}: veScale-FSDP keeps whole "
            "rows of dim 0 per rank (uneven where needed, so tensors with fewer rows than ranks need no other dim). "
            "Training is the same; the sharded parameters' placement is RaggedShard, not Shard(d). "
            "(Warned once per process.)",
            stacklevel=5,  # the user's fully_shard call (via fully_shard, agree_on_plan, plan)
        )
    return own_mesh


def _parameter_mesh(fqn: str, mesh_info: Any, device: torch.device) -> DeviceMesh:
    """The mesh a ``ShardPlacementResult`` names, in the layouts a unit's mesh may have: 1-D
    (shard over it) or 2-D HSDP (replicate over dim 0, shard over dim 1)."""
    param_mesh = mesh_info.mesh
    replicate_dim = getattr(mesh_info, "replicate_mesh_dim", None)
    shard_dim = getattr(mesh_info, "shard_mesh_dim", None)
    layout_ok = (param_mesh.ndim == 1 and shard_dim == 0 and replicate_dim is None) or (
        param_mesh.ndim == 2 and shard_dim == 1 and replicate_dim == 0
    )
    if not layout_ok:
        raise NotImplementedError(
            f"shard_placement_fn put {fqn!r} on {type(mesh_info).__name__}(mesh={param_mesh}, shard_mesh_dim={shard_dim}, "
            f"replicate_mesh_dim={replicate_dim}): veScale-FSDP shards over a 1-D mesh, or replicates over dim 0 and "
            "shards over dim 1 of a 2-D one (HSDP)"
        )
    if device.type != "meta" and param_mesh.device_type != device.type:
        raise ValueError(f"shard_placement_fn put {fqn!r} on a {param_mesh.device_type!r} mesh; its parameters are on {device.type!r}")
    if param_mesh.get_coordinate() is None:
        raise ValueError(f"shard_placement_fn put {fqn!r} on mesh {param_mesh}, which does not hold this rank ({torch.distributed.get_rank()})")
    return param_mesh


def _refuse_with_parameter_meshes(own_mesh: dict[str, DeviceMesh], reshard_after_forward: Any, spmd: Any) -> None:
    first = next(iter(own_mesh))
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward} with parameters on their own mesh ({first!r}, from "
            "shard_placement_fn): pass True or False, as FSDP2 needs for such units"
        )
    if spmd is not None:
        raise NotImplementedError(f"dp_mesh_dims with parameters on their own mesh ({first!r}, from shard_placement_fn)")


# One warning per process for Shard(d > 0) answers (a model asks it for every layer).
_SHARD_DIM_WARNED: list[bool] = []


def _pre_forward_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return module._vescale_fsdp_unit.pre_forward(module, args, kwargs)


def _post_forward_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    return module._vescale_fsdp_unit.post_forward(module, output)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unit's pre- and post-forward logic around ``module.<method_name>`` too."""
    unit = _unit_of(module)
    original = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = unit.pre_forward(module, args, kwargs)
        return unit.post_forward(module, original(*args, **kwargs))

    setattr(module, method_name, wrapped)

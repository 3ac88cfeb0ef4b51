"""``vescale_plugins.fully_shard``: FSDP2's API over RaggedShard parameters and DBuffers.

Same names, arguments and semantics as ``torch.distributed.fsdp.fully_shard`` wherever FSDP2
has them; ``block_size_fn`` is ours. Everything is validated before the module is touched
and before any collective runs, so bad input leaves the module as it was.
"""

from __future__ import annotations

from typing import Any, Callable, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from .fsdp_unit import FSDPUnit, _iter_units

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

    def reset_iter_state(self) -> None:
        """Not supported yet (issue 11): after an exception mid-step, rebuild the model."""
        raise NotImplementedError(
            "reset_iter_state() is not supported by vescale_plugins.fully_shard yet; after an "
            "exception mid-forward/backward, rebuild the model from a checkpoint"
        )

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's all-reduce switch: with a 1-D mesh there is no all-reduce, so (as in FSDP2)
        it changes nothing; the value is validated and kept."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"requires_all_reduce must be a bool, got {requires_all_reduce!r}")
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

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
            unit.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list["VeScaleFSDPModule"]) -> None:
        """Start these units' all-gathers when this unit's forward starts (default: the unit
        that ran after it in the previous forward; ``[]`` for none)."""
        self._vescale_fsdp_unit.forward_prefetch = [_unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["VeScaleFSDPModule"]) -> None:
        """Start these units' all-gathers during this unit's backward, once its first gradient
        has landed (default: the unit that ran before it in forward)."""
        self._vescale_fsdp_unit.backward_prefetch = [_unit_of(m) for m in modules]

    def set_find_unused_parameters(self, enabled: bool) -> None:
        """Allow parameters that get gradients on some ranks only (data-dependent routing:
        mixture-of-experts layers, conditional branches), as DDP's ``find_unused_parameters``.

        On, a parameter this rank's batch never reached still gets the other ranks' reduced
        gradient, and one no rank's batch reached keeps ``grad=None``, at the cost of one small
        all-reduce (and a host sync) at the end of each backward that reduces. Off (the
        default, as in DDP and FSDP2), every parameter must get a gradient on every rank or on
        none; a rank without one leaves its ``grad`` as ``None``. Set it on the root, on every
        rank alike.
        """
        for unit in self._units(True):
            unit.find_unused_parameters = enabled

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        for unit in self._units(True):
            unit.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the group size."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        for unit in self._units(True):
            unit.gradient_divide_factor = float(factor)

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
        raise NotImplementedError(
            f"reshard_after_forward={value}: resharding to a smaller group after forward is not "
            "supported yet; use True, False or None"
        )
    raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")


def _resolve_mesh(mesh: DeviceMesh | None, device: torch.device) -> DeviceMesh:
    if mesh is None:
        if not torch.distributed.is_initialized():
            raise RuntimeError("fully_shard needs an initialised process group or an explicit mesh")
        device_type = "cuda" if device.type == "cuda" else "cpu"
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard got a {mesh.ndim}-D mesh: hybrid sharding (replicate x shard) is not "
            "supported yet; pass a 1-D mesh"
        )
    return mesh


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
    leading = param.shape[0] if param.dim() > 0 else 1
    if leading % rows:
        divisors = [d for d in range(1, leading + 1) if leading % d == 0]
        raise ValueError(
            f"block_size_fn({fqn!r}) asks for blocks of {rows} rows, but the parameter has "
            f"{leading} rows (shape {tuple(param.shape)}); use a divisor of {leading}: {divisors}"
        )
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
    block_size_fn: BlockSizeFn | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters as one unit, like ``torch.distributed.fsdp.fully_shard``.

    Parameters become ``nn.Parameter(DTensor)`` with a :class:`RaggedShard` placement whose
    local tensor is a view of the unit's sharded DBuffer, laid out by the planner so that no
    block of ``block_size_fn(name, param)`` rows (default one row) straddles two ranks.
    Apply it to each block first, then to the root, as with FSDP2. Returns ``module``.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _validate(modules, reshard_after_forward, shard_placement_fn, offload_policy)
    ignored = set(ignored_params or ())
    params, shared = _collect_params(modules, ignored)
    if shared:
        raise ValueError(
            "parameters shared between this unit and a unit inside it: " + ", ".join(shared)
            + "; shared (e.g. tied) parameters must belong to one unit: apply fully_shard to a "
            "module that contains every user of them"
        )
    _refuse_tensor_extensions(params)
    with_blocks = [(fqn, owners, p, _block_rows(fqn, p, block_size_fn)) for fqn, owners, p in params]
    device = next((p.device for _, _, p in params), torch.device("cpu"))
    mesh = _resolve_mesh(mesh, device)
    unit = FSDPUnit(modules, with_blocks, mesh, reshard_after_forward, mp_policy)
    unit.register_state_dict_hooks()
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


def _validate(modules: list[nn.Module], reshard_after_forward: Any, shard_placement_fn: Any, offload_policy: Any) -> None:
    _check_reshard_after_forward(reshard_after_forward)
    if shard_placement_fn is not None:
        raise NotImplementedError("shard_placement_fn is not supported: veScale-FSDP plans placements itself; use block_size_fn")
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

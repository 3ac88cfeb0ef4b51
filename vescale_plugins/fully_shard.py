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
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from .fsdp_unit import FSDPUnit, _iter_units

__all__ = ["fully_shard", "VeScaleFSDPModule", "UnshardHandle", "register_fsdp_forward_method"]

BlockSizeFn = Callable[[str, nn.Parameter], "int | None"]


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` blocks until the parameters are full."""

    def __init__(self, unit: FSDPUnit) -> None:
        self._unit = unit

    def wait(self) -> None:
        self._unit.use_unsharded_params()


class VeScaleFSDPModule:
    """Mixed into every module ``fully_shard`` manages (FSDP2's ``FSDPModule`` methods)."""

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
        result = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self._vescale_fsdp_unit.readopt_sharded_params()
        return result


_CLASS_CACHE: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"VeScaleFSDP{cls.__name__}", (VeScaleFSDPModule, cls), {})
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
    Blocks are counted from row 0 and need not divide the rows (1031 rows in blocks of 32:
    32 blocks of 32 rows and a last one of 7); ``vescale_plugins.optim.tile_rows(32)`` asks
    for the 32x32 tiles of block-wise 8-bit optimizers.
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
                f"fully_shard on an {type(m).__name__}: it has no forward, so no hook would ever "
                "gather its parameters; shard each of its blocks, or pass them as a list"
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

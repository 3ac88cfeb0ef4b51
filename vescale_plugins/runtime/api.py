"""``fully_shard``: FSDP2's API over RaggedShard parameters and DBuffers.

Same names, arguments and semantics as ``torch.distributed.fsdp.fully_shard`` wherever FSDP2
has them; ``block_size_fn`` and ``buffer_split_cost`` are ours. Everything is checked (on
every rank, before any collective: :mod:`.setup`) before the module is touched, so bad
input leaves the module as it was.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable
from typing import Any, overload

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from vescale_plugins.dbuffer.planning import BufferSplitCost
from vescale_plugins.runtime import registry
from vescale_plugins.runtime.comm_policy import QuantizedComm
from vescale_plugins.runtime.composable import register_as_fully_shard
from vescale_plugins.runtime.dynamo import eager_hook, mark_managed
from vescale_plugins.runtime.module import fsdp_class, fsdp_state_of, group_of
from vescale_plugins.runtime.param_group import FSDPParamGroup
from vescale_plugins.runtime.registry import record_sharded
from vescale_plugins.runtime.setup import BlockSizeFn, plan_unit_setup
from vescale_plugins.runtime.state import post_forward, pre_forward
from vescale_plugins.runtime.unit_device import mesh_device, move_unit_states

__all__ = ["fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]

# A unit's modules, hooks and DBuffers form reference cycles, and a DBuffer holds its process
# group: a unit the program dropped is freed only by the collector. Collected at exit while the
# interpreter is whole, not during its teardown, where destroying a gloo group whose threads are
# still up aborted the process ("terminate called without an active exception", 3 exits in 8
# after training one unit at W=2; tests/runtime/stock_fsdp2_run.py --mode built).
atexit.register(gc.collect)


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any = ...,
    block_size_fn: BlockSizeFn | None = ...,
    buffer_split_cost: BufferSplitCost = ...,
    comm_policy: QuantizedComm | None = ...,
) -> nn.Module: ...
@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any = ...,
    block_size_fn: BlockSizeFn | None = ...,
    buffer_split_cost: BufferSplitCost = ...,
    comm_policy: QuantizedComm | None = ...,
) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    block_size_fn: BlockSizeFn | None = None,
    buffer_split_cost: BufferSplitCost = BufferSplitCost(),
    comm_policy: QuantizedComm | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters as one unit, like ``torch.distributed.fsdp.fully_shard``.

    Parameters become ``nn.Parameter(DTensor)`` with a :class:`RaggedShard` placement whose
    local tensor is a view of the unit's sharded DBuffer, laid out by the planner so that no
    block of ``block_size_fn(name, param)`` rows (default one row) straddles two ranks.
    Blocks are counted from row 0 and need not divide the rows (1031 rows in blocks of 32:
    32 blocks of 32 rows and a last one of 7); ``vescale_plugins.optim.tile_rows(32)`` asks
    for the 32x32 tiles of block-wise 8-bit optimizers. ``buffer_split_cost`` says when a
    unit's parameters are split into several buffers (each its own collectives) to save
    padding; give every rank the same one. ``comm_policy=QuantizedComm(weights="int8", grads=...)``
    makes the unit's collectives move block-quantized values (off by default: exact, as FSDP2).
    As FSDP2, the default mesh is over every rank on the accelerator, and the unit's CPU
    parameters and buffers move to the mesh's device first (meta ones stay for deferred init).
    Apply it to each block first, then to the root, as with FSDP2. Returns ``module``.
    """
    registry.install()  # our torch patches and hook: at the first unit, never at import
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    unit = plan_unit_setup(
        modules,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
        block_size_fn=block_size_fn,
        comm_policy=comm_policy,
    )
    move_unit_states(modules, [s.param for s in unit.params], mesh_device(unit.mesh))
    group = FSDPParamGroup(
        modules,
        unit.params,
        unit.mesh,
        unit.reshard_after_forward,
        mp_policy,
        buffer_split_cost,
        offload_policy,
        comm_policy,
    )
    record_sharded(modules, [(spec.fqn, spec.param) for spec in unit.params])
    for m in modules:
        m._vescale_fsdp_unit = group  # type: ignore[assignment]  # torch stubs Module.__setattr__ for tensors and modules; it takes any value
        m.__class__ = fsdp_class(type(m))
        mark_managed(m)
        m.register_forward_pre_hook(_pre_forward_hook, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward_hook, prepend=False)
    register_as_fully_shard(modules, fsdp_state_of)
    return module


# The hooks read the unit straight from the attribute set beside them above (group_of's check
# is for callers that may hold any module): twice per unit per step.
@eager_hook
def _pre_forward_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return pre_forward(module._vescale_fsdp_unit, module, args, kwargs)  # type: ignore[arg-type]  # set at fully_shard


@eager_hook
def _post_forward_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    return post_forward(module._vescale_fsdp_unit, module, output)  # type: ignore[arg-type]  # set at fully_shard


_eager_pre_forward = eager_hook(pre_forward)
_eager_post_forward = eager_hook(post_forward)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unit's pre- and post-forward logic around ``module.<method_name>`` too."""
    group: FSDPParamGroup = group_of(module)
    original = getattr(module, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _eager_pre_forward(group, module, args, kwargs)
        return _eager_post_forward(group, module, original(*args, **kwargs))

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's ``share_comm_ctx``: make several roots (pipeline stages' model chunks) share
    their collectives' streams. Every unit of this process already issues its collectives on
    one set of streams per device (:func:`vescale_plugins.dbuffer.streams.comm_streams_for`),
    so this only checks that each module is a unit, as FSDP2 requires of its arguments."""
    for module in modules:
        if vars(module).get("_vescale_fsdp_unit") is None:
            raise ValueError(
                f"share_comm_ctx takes modules vescale_plugins.fully_shard was applied to; got a {type(module).__name__}"
            )

"""Lightning's ``FSDPStrategy`` arguments, translated into ours.

Code written for ``lightning.{pytorch,fabric}.strategies.FSDPStrategy`` (LitGPT's pretrain and
fine-tune scripts, for one) passes FSDP1's vocabulary: ``sharding_strategy``, FSDP1's
``MixedPrecision``, the older ``activation_checkpointing`` and FSDP1 constructor keywords
through ``**kwargs``. Both strategies accept all of it. Where an argument has a meaning under
veScale-FSDP it is mapped onto our options (a mesh, ``reshard_after_forward``, an
``mp_policy``, prefetch settings, a broadcast from rank 0, ignored parameters); where it only
tunes FSDP1's internals it is accepted and logged once; where ignoring it would train something
else (``param_init_fn``, ``process_group``) it is refused with what to pass instead. A keyword neither Lightning's ``FSDPStrategy`` nor FSDP1 takes is a ``TypeError``
naming it. The table in ``docs/lightning.md`` lists every argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
)

from .options import TENSOR_PARALLEL

__all__ = [
    "FSDP1_KEYWORDS",
    "NODES_MESH",
    "REPLICATE_MESH",
    "FSDPArguments",
    "translate_fsdp_arguments",
    "resolve_mesh_request",
    "sharding_strategy_in_force",
]

# FSDP1's constructor keywords that Lightning's FSDPStrategy forwards through **kwargs (the
# others it names itself).
FSDP1_KEYWORDS: frozenset[str] = frozenset(inspect.signature(FullyShardedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "sharding_strategy",
    "cpu_offload",
    "auto_wrap_policy",
    "mixed_precision",
    "device_mesh",
}
# Keywords that only tune how FSDP1 runs; veScale-FSDP's behaviour is stated in the log line.
_ACCEPTED = {
    "limit_all_gathers": "a unit's all-gather is issued by its own hooks or by the unit before it (one unit "
    "of prefetch), as in FSDP2, which has no such option",
    "use_orig_params": "parameters are always the original ones (DTensors), as FSDP1's use_orig_params=True",
    "device_id": "each rank's device is the strategy's root_device",
}
# Keywords whose silent omission would train a different model.
_REFUSED = {
    "param_init_fn": "meta-device modules are initialised with their reset_parameters(); override it instead",
    "process_group": "pass device_mesh= (a DeviceMesh, or its shape (replicas, shard_size)) instead",
}
# Mesh requests resolved once the world is known (see resolve_mesh_request).
NODES_MESH = "replicate across nodes, shard within a node"
REPLICATE_MESH = "replicate on every rank"

_logged: set[str] = set()


@dataclass(frozen=True)
class FSDPArguments:
    """Lightning ``FSDPStrategy`` arguments as our options; ``None`` leaves an option as the user set it."""

    reshard_after_forward: bool | None
    device_mesh: Any
    mp_policy: MixedPrecisionPolicy | None
    activation_checkpointing_policy: Any
    sync_module_states: bool
    forward_prefetch: bool | None
    backward_prefetch: bool | None
    ignored: tuple[nn.Module | nn.Parameter, ...]


def translate_fsdp_arguments(
    strategy_name: str,
    *,
    sharding_strategy: str | ShardingStrategy | None,
    reshard_after_forward: bool | int | None,
    device_mesh: Any,
    data_parallel_size: Any,
    tensor_parallel_size: Any,
    mixed_precision: MixedPrecision | None,
    mp_policy: MixedPrecisionPolicy | None,
    activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None,
    activation_checkpointing_policy: Any,
    kwargs: dict[str, Any],
) -> FSDPArguments:
    """Check Lightning's ``FSDPStrategy`` arguments (before any process starts) and map them onto ours."""
    unknown = sorted(set(kwargs) - FSDP1_KEYWORDS)
    if unknown:
        raise TypeError(
            f"{strategy_name}.__init__() got an unexpected keyword argument {unknown[0]!r}: neither Lightning's "
            "FSDPStrategy nor FSDP1's FullyShardedDataParallel takes it"
        )
    for name, remedy in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name}= (an FSDP1 option) is not supported by {strategy_name}: {remedy}")
    for name, behaviour in _ACCEPTED.items():
        if name in kwargs:
            _log_once(
                name, f"{strategy_name}: FSDP1's {name}={kwargs[name]!r} is accepted and changes nothing: {behaviour}"
            )
    reshard, mesh = _sharding(
        sharding_strategy, reshard_after_forward, device_mesh, data_parallel_size, tensor_parallel_size
    )
    return FSDPArguments(
        reshard_after_forward=reshard,
        device_mesh=mesh,
        mp_policy=_mp_policy(mixed_precision, mp_policy, strategy_name),
        activation_checkpointing_policy=_checkpointing(activation_checkpointing, activation_checkpointing_policy),
        sync_module_states=_flag(kwargs, "sync_module_states", False),
        forward_prefetch=None if "forward_prefetch" not in kwargs else _flag(kwargs, "forward_prefetch", False),
        backward_prefetch=_backward_prefetch(kwargs),
        ignored=_ignored(kwargs),
    )


def resolve_mesh_request(request: Any, num_nodes: int, world_size: int) -> Any:
    """The mesh shape a ``sharding_strategy`` asked for, now that the world is known."""
    if request == NODES_MESH:
        if world_size % num_nodes:
            raise ValueError(f"HYBRID_SHARD: {world_size} processes do not split evenly over {num_nodes} nodes")
        return (num_nodes, world_size // num_nodes)
    if request == REPLICATE_MESH:
        return (world_size, 1)
    return request


def sharding_strategy_in_force(requested: Any, reshard_after_forward: Any, mesh_request: Any) -> ShardingStrategy:
    """FSDP1's name for how the model is sharded (what Lightning's ``FSDPStrategy.sharding_strategy`` holds)."""
    if requested is not None:
        return _sharding_strategy(requested)
    if mesh_request == REPLICATE_MESH:
        return ShardingStrategy.NO_SHARD
    keeps_gathered = reshard_after_forward is False
    if mesh_request == NODES_MESH or _data_parallel_dims(mesh_request) == 2:
        return ShardingStrategy._HYBRID_SHARD_ZERO2 if keeps_gathered else ShardingStrategy.HYBRID_SHARD
    return ShardingStrategy.SHARD_GRAD_OP if keeps_gathered else ShardingStrategy.FULL_SHARD


def _sharding(
    sharding_strategy: Any,
    reshard_after_forward: Any,
    device_mesh: Any,
    data_parallel_size: Any,
    tensor_parallel_size: Any,
) -> tuple[Any, Any]:
    """``sharding_strategy`` as (reshard_after_forward, device mesh request), as FSDP2 spells FSDP1's strategies."""
    if sharding_strategy is None:
        return reshard_after_forward, device_mesh
    strategy = _sharding_strategy(sharding_strategy)
    if reshard_after_forward is not None:
        raise ValueError(
            f"pass either sharding_strategy={sharding_strategy!r} or reshard_after_forward={reshard_after_forward!r}, "
            "not both (SHARD_GRAD_OP is reshard_after_forward=False, FULL_SHARD the default)"
        )
    if data_parallel_size != "auto" or tensor_parallel_size != 1:
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} cannot be combined with data_parallel_size / "
            "tensor_parallel_size; pass a DeviceMesh with a 'tensor_parallel' dim instead"
        )
    # FULL_SHARD keeps the root gathered between forward and backward, as FSDP1 does: our default (None).
    reshard = False if strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2) else None
    data_parallel_dims = _data_parallel_dims(device_mesh)
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        if device_mesh is None:
            return reshard, NODES_MESH
        if data_parallel_dims != 2:
            raise ValueError(
                f"sharding_strategy={sharding_strategy!r} needs a 2-D device_mesh (replicas, shard_size), "
                f"got {device_mesh!r}"
            )
        return reshard, device_mesh
    if strategy == ShardingStrategy.NO_SHARD:
        if device_mesh is not None:
            raise ValueError(
                f"pass either sharding_strategy={sharding_strategy!r} (every rank holds the whole model) or "
                "device_mesh, not both"
            )
        # A 2-D mesh (world_size, 1): every rank holds all parameters, gradients are all-reduced (as DDP).
        return False, REPLICATE_MESH
    if data_parallel_dims == 2:
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} shards over every rank, but device_mesh={device_mesh!r} is "
            "2-D (hybrid sharding); pass sharding_strategy='HYBRID_SHARD' with it"
        )
    return reshard, device_mesh


def _sharding_strategy(value: Any) -> ShardingStrategy:
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str) and value.upper() in ShardingStrategy.__members__:
        return ShardingStrategy[value.upper()]
    raise ValueError(
        f"sharding_strategy={value!r}: use one of {', '.join(repr(s) for s in ShardingStrategy.__members__)} "
        "or torch.distributed.fsdp.ShardingStrategy"
    )


def _data_parallel_dims(device_mesh: Any) -> int | None:
    if isinstance(device_mesh, DeviceMesh):
        return device_mesh.ndim - (TENSOR_PARALLEL in (device_mesh.mesh_dim_names or ()))
    if isinstance(device_mesh, tuple):
        return len(device_mesh)
    return None


def _mp_policy(
    mixed_precision: MixedPrecision | None, mp_policy: MixedPrecisionPolicy | None, strategy_name: str
) -> MixedPrecisionPolicy | None:
    """FSDP1's ``MixedPrecision`` as FSDP2's policy: the dtypes and the input cast carry over."""
    if mixed_precision is None:
        return mp_policy
    if mp_policy is not None:
        raise ValueError("pass either mixed_precision (FSDP1's MixedPrecision) or mp_policy (FSDP2's), not both")
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a torch.distributed.fsdp.MixedPrecision, got {type(mixed_precision).__name__}"
        )
    dropped = []
    if mixed_precision.buffer_dtype is not None:
        dropped.append(f"buffer_dtype={mixed_precision.buffer_dtype} (buffers keep the dtype they were built in)")
    if mixed_precision.keep_low_precision_grads:
        dropped.append("keep_low_precision_grads=True (gradients reach the optimizer in the parameters' dtype)")
    if dropped:
        _log_once("mixed_precision", f"{strategy_name}: mixed_precision's {'; '.join(dropped)} have no effect")
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        cast_forward_inputs=mixed_precision.cast_forward_inputs or mixed_precision.cast_root_forward_inputs,
    )


def _checkpointing(activation_checkpointing: Any, activation_checkpointing_policy: Any) -> Any:
    """The older ``activation_checkpointing`` (a layer class or a list of them) as the policy's set."""
    if activation_checkpointing is None:
        return activation_checkpointing_policy
    if activation_checkpointing_policy is not None:
        raise ValueError(
            "pass either activation_checkpointing or activation_checkpointing_policy, not both (use the latter)"
        )
    if isinstance(activation_checkpointing, Iterable) and not isinstance(activation_checkpointing, (str, type)):
        return set(activation_checkpointing)
    return {activation_checkpointing}


def _flag(kwargs: dict[str, Any], name: str, default: bool) -> bool:
    value = kwargs.get(name, default)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _backward_prefetch(kwargs: dict[str, Any]) -> bool | None:
    """``None`` switches backward prefetching off; FSDP1's two timings both mean ours (the default)."""
    if "backward_prefetch" not in kwargs:
        return None
    value = kwargs["backward_prefetch"]
    if value is None:
        return False
    if not isinstance(value, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a torch.distributed.fsdp.BackwardPrefetch or None, got {value!r}")
    return True


def _ignored(kwargs: dict[str, Any]) -> tuple[nn.Module | nn.Parameter, ...]:
    """FSDP1's ``ignored_modules`` (modules) or ``ignored_states`` (parameters, or modules): neither
    sharded nor reduced, FSDP2's ``ignored_params``."""
    modules, states = kwargs.get("ignored_modules"), kwargs.get("ignored_states")
    if modules is not None and states is not None:
        raise ValueError("pass either ignored_modules or ignored_states, not both (as FSDP1)")
    name, value = ("ignored_modules", modules) if modules is not None else ("ignored_states", states)
    if value is None:
        return ()
    ignored = tuple(value) if isinstance(value, Iterable) and not isinstance(value, nn.Module) else (value,)
    kinds = (nn.Module,) if name == "ignored_modules" else (nn.Module, nn.Parameter)
    if not all(isinstance(x, kinds) for x in ignored):
        what = "nn.Module objects" if name == "ignored_modules" else "nn.Parameter or nn.Module objects"
        raise TypeError(f"{name} must hold {what} (of the model to be set up), got {value!r}")
    return ignored


def _log_once(key: str, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        rank_zero_info(message)

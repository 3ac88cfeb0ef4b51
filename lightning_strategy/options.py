"""The arguments both strategies share, checked when the strategy is built.

Everything here is validated in the strategy's constructor, before any process is launched or
any collective runs, so a bad configuration fails at ``Trainer(...)`` / ``Fabric(...)`` with a
message that says what to change. The only check that has to wait for the model is whether a
wrap policy names a module that exists (:meth:`ShardingOptions.units`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from vescale_plugins import BlockSizeFn, QuantizedComm
from vescale_plugins.wrap import default_units, units_of_classes

__all__ = [
    "WrapPolicy",
    "StateDictType",
    "DeviceMeshRequest",
    "ShardingOptions",
    "check_state_dict_type",
    "check_device_mesh",
    "check_parallel_sizes",
    "build_device_mesh",
    "data_parallel_mesh",
    "data_parallel_sampler_kwargs",
    "DATA_PARALLEL",
    "TENSOR_PARALLEL",
]

UnitFn = Callable[[nn.Module], list[nn.Module]]
# The layer classes (types or class names) to shard as units, as Lightning's FSDPStrategy accepts
# them (a set of classes or torch's ModuleWrapPolicy), or a function that returns the units.
WrapPolicy = Iterable[type[nn.Module] | str] | type[nn.Module] | str | UnitFn | None
StateDictType = Literal["sharded", "full"]
# None (the default: shard over every rank), a mesh, or its shape: ``(world_size,)`` to shard,
# ``(replicas, shard_size)`` for hybrid sharding (replicate across, shard within), as
# Lightning's FSDPStrategy takes ``device_mesh`` for HYBRID_SHARD.
DeviceMeshRequest = DeviceMesh | tuple[int, ...] | None
# Lightning's ModelParallelStrategy's mesh dim names: configure_model applies tensor parallelism
# on ``device_mesh["tensor_parallel"]``; the strategy shards over the other dims.
DATA_PARALLEL, TENSOR_PARALLEL = "data_parallel", "tensor_parallel"

STATE_DICT_TYPES = ("sharded", "full")


@dataclass(frozen=True)
class ShardingOptions:
    """How a strategy asks the core's ``shard_model`` to shard a model.

    ``unit_classes`` / ``unit_fn`` pick the units (default: every block of every ``nn.ModuleList``),
    the rest are ``fully_shard``'s arguments. ``mp_policy`` is None when the precision setting
    decides it.
    """

    unit_classes: tuple[type[nn.Module] | str, ...] | None = None
    unit_fn: UnitFn | None = None
    reshard_after_forward: bool | int | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    block_size_fn: BlockSizeFn | None = None
    find_unused_parameters: bool = False
    offload_policy: CPUOffloadPolicy | None = None
    # FSDP1's keywords, as Lightning's FSDPStrategy passes them (see fsdp_arguments.py): broadcast
    # rank 0's parameters and buffers before sharding; prefetch switched off where False.
    sync_module_states: bool = False
    forward_prefetch: bool | None = None
    backward_prefetch: bool | None = None
    # FSDP1's ignored_modules / ignored_states: their parameters are neither sharded nor reduced.
    ignored: tuple[nn.Module | nn.Parameter, ...] = ()
    comm_policy: QuantizedComm | None = None  # quantized collectives (fully_shard's comm_policy)

    @classmethod
    def from_arguments(
        cls,
        auto_wrap_policy: WrapPolicy,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy | None,
        block_size_fn: BlockSizeFn | None,
        find_unused_parameters: bool = False,
        cpu_offload: Any = None,
        sync_module_states: bool = False,
        forward_prefetch: bool | None = None,
        backward_prefetch: bool | None = None,
        ignored: tuple[nn.Module | nn.Parameter, ...] = (),
        comm_policy: QuantizedComm | None = None,
    ) -> ShardingOptions:
        """Check a strategy's sharding arguments and normalise the wrap policy."""
        if (
            reshard_after_forward is not None
            and not isinstance(reshard_after_forward, (bool, int))
            or (type(reshard_after_forward) is int and reshard_after_forward < 1)
        ):
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward!r}: use True (free gathered parameters after each "
                "unit's forward), False (keep them until backward), None (True for every unit but the root) or "
                "k ranks (keep each unit sharded over groups of k ranks until backward; k divides the shard size)"
            )
        if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                "mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                f"{type(mp_policy).__name__}; to train in bf16, pass precision='bf16-mixed' or 'bf16-true' to the "
                "Trainer / Fabric instead"
            )
        if block_size_fn is not None and not callable(block_size_fn):
            raise TypeError(f"block_size_fn must be a function (name, param) -> rows or None, got {block_size_fn!r}")
        if comm_policy is not None and not isinstance(comm_policy, QuantizedComm):
            raise TypeError(
                f"comm_policy must be a vescale_plugins.QuantizedComm or None, got {type(comm_policy).__name__}"
            )
        if not isinstance(find_unused_parameters, bool):
            raise TypeError(f"find_unused_parameters must be True or False, got {find_unused_parameters!r}")
        unit_classes, unit_fn = _normalise_wrap_policy(auto_wrap_policy)
        return cls(
            unit_classes,
            unit_fn,
            reshard_after_forward,
            mp_policy,
            block_size_fn,
            find_unused_parameters,
            _offload_policy(cpu_offload),
            sync_module_states,
            forward_prefetch,
            backward_prefetch,
            ignored,
            comm_policy,
        )

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The modules to shard before the root; raises if the policy names no module of ``model``."""
        if self.unit_fn is not None:
            units = list(self.unit_fn(model))
            inside = {id(m) for m in model.modules() if m is not model}
            strays = [type(u).__name__ for u in units if id(u) not in inside]
            if strays:
                raise ValueError(
                    f"auto_wrap_policy returned modules that are not submodules of {type(model).__name__}: {strays}; "
                    "return modules of the model it is given (not the model itself)"
                )
            return units
        if self.unit_classes is None:
            return default_units(model)
        try:
            units = units_of_classes(model, self.unit_classes)
        except ValueError:  # the core refuses class names that match nothing; say so with the classes there are
            units = []
        if not units:
            names = sorted(c if isinstance(c, str) else c.__name__ for c in self.unit_classes)
            present = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ValueError(
                f"auto_wrap_policy names {names}, but {type(model).__name__} contains no module of these classes "
                f"(it contains: {present}); name the classes of the model's blocks"
            )
        return units

    def ignored_params(self) -> set[nn.Parameter]:
        """The parameters ``fully_shard`` leaves alone (``ignored_modules`` / ``ignored_states``)."""
        return {p for x in self.ignored for p in ([x] if isinstance(x, nn.Parameter) else x.parameters())}


def module_classes(policy: type | str | Iterable[Any], argument: str) -> tuple[type[nn.Module] | str, ...]:
    """``policy``, one or several nn.Module classes or class names, as a tuple; a ``TypeError``
    naming ``argument`` when it names anything else or nothing."""
    classes = (policy,) if isinstance(policy, (type, str)) else tuple(policy)
    bad = [c for c in classes if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)))]
    if bad or not classes:
        raise TypeError(
            f"{argument} must name nn.Module classes (a set of types or class names), got {bad or 'nothing'}"
        )
    return classes


def _offload_policy(cpu_offload: Any) -> CPUOffloadPolicy | None:
    """``cpu_offload`` as Lightning's FSDPStrategy takes it (a bool or FSDP1's ``CPUOffload``),
    or FSDP2's ``CPUOffloadPolicy``: the policy ``fully_shard`` gets (None: no offload)."""
    if cpu_offload is None or isinstance(cpu_offload, bool):
        return CPUOffloadPolicy() if cpu_offload else None
    if isinstance(cpu_offload, CPUOffload):
        return CPUOffloadPolicy() if cpu_offload.offload_params else None
    if isinstance(cpu_offload, CPUOffloadPolicy):
        return cpu_offload
    raise TypeError(
        f"cpu_offload must be a bool, torch.distributed.fsdp.CPUOffload or CPUOffloadPolicy, got {cpu_offload!r}"
    )


def _normalise_wrap_policy(policy: Any) -> tuple[tuple[Any, ...] | None, UnitFn | None]:
    if policy is None:
        return None, None
    if isinstance(policy, ModuleWrapPolicy):
        # Lightning's FSDPStrategy turns a set of classes into this; accept it as it is.
        return tuple(policy._module_classes), None
    if isinstance(policy, (type, str, Iterable)):
        return module_classes(policy, "auto_wrap_policy"), None
    if callable(policy):
        if _required_positional_arguments(policy) != 1:
            raise TypeError(
                "auto_wrap_policy as a function takes the model and returns the modules to shard as units; "
                "FSDP1-style predicates (module, recurse, nonwrapped_numel) -> bool are not supported: "
                "pass the layer classes instead, e.g. auto_wrap_policy={Block}"
            )
        return None, policy
    raise TypeError(
        f"auto_wrap_policy must be None, a set of nn.Module classes or class names, or a function "
        f"model -> list of modules; got {type(policy).__name__}"
    )


def _required_positional_arguments(fn: Callable[..., Any]) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


def check_state_dict_type(state_dict_type: Any) -> None:
    """``"sharded"`` (a DCP directory, no gathering) or ``"full"`` (one file from rank 0)."""
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(
            f"state_dict_type={state_dict_type!r}: use 'sharded' (each rank writes its shards to a directory, "
            "loadable at any world size) or 'full' (rank 0 writes one file a plain model can load)"
        )


def check_device_mesh(device_mesh: Any) -> None:
    """A 1-D mesh (shard over all of it), a 2-D one (replicate x shard, HSDP), or a DeviceMesh
    with a ``"tensor_parallel"`` dim and one or two data-parallel dims."""
    if device_mesh is None:
        return
    tensor_parallel = False
    if isinstance(device_mesh, DeviceMesh):
        ndim = device_mesh.ndim
        tensor_parallel = TENSOR_PARALLEL in (device_mesh.mesh_dim_names or ())
    elif isinstance(device_mesh, tuple) and all(isinstance(n, int) and n > 0 for n in device_mesh):
        ndim = len(device_mesh)
    else:
        raise TypeError(
            f"device_mesh must be a DeviceMesh, a shape tuple like (world_size,) or (replicas, shard_size), "
            f"or None; got {device_mesh!r}"
        )
    if ndim - tensor_parallel not in (1, 2):
        raise NotImplementedError(
            f"device_mesh with {ndim} dimensions: veScale-FSDP takes a 1-D mesh (shard) or a 2-D one "
            "(replicate, shard) for hybrid sharding; for tensor parallelism pass tensor_parallel_size "
            f"(and data_parallel_size), or a DeviceMesh with a {TENSOR_PARALLEL!r} dim besides those"
        )


def check_parallel_sizes(data_parallel_size: Any, tensor_parallel_size: Any, device_mesh: Any) -> None:
    """``ModelParallelStrategy``'s sizes: ``"auto"`` (world size / tensor_parallel_size) or a count."""
    if not (data_parallel_size == "auto" or _is_count(data_parallel_size)):
        raise ValueError(f"data_parallel_size={data_parallel_size!r}: use 'auto' or a number of processes >= 1")
    if not _is_count(tensor_parallel_size):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: use a number of processes >= 1")
    if device_mesh is not None and (data_parallel_size != "auto" or tensor_parallel_size != 1):
        raise ValueError(
            "pass either device_mesh or data_parallel_size / tensor_parallel_size, not both; a DeviceMesh "
            f"with a {TENSOR_PARALLEL!r} dim combines tensor parallelism with hybrid sharding"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def build_device_mesh(
    device_mesh: DeviceMeshRequest,
    world_size: int,
    device: torch.device,
    data_parallel_size: int | Literal["auto"] = "auto",
    tensor_parallel_size: int = 1,
) -> DeviceMesh:
    """The strategy's mesh; needs the process group. With sizes: ``(data_parallel_size,
    tensor_parallel_size)`` named ``("data_parallel", "tensor_parallel")``, as Lightning's
    ModelParallelStrategy builds it; else the requested mesh (2-D: replicate, shard)."""
    if device_mesh is None and (data_parallel_size != "auto" or tensor_parallel_size != 1):
        if data_parallel_size == "auto":
            if world_size % tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} does not divide the {world_size} processes"
                )
            data_parallel_size = world_size // tensor_parallel_size
        if data_parallel_size * tensor_parallel_size != world_size:
            raise ValueError(
                f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} must "
                f"equal the {world_size} processes"
            )
        return init_device_mesh(
            device.type, (data_parallel_size, tensor_parallel_size), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL)
        )
    if isinstance(device_mesh, DeviceMesh):
        mesh = device_mesh
    else:
        shape = device_mesh if device_mesh is not None else (world_size,)
        if math.prod(shape) != world_size:
            raise ValueError(f"device_mesh={shape} does not cover the {world_size} processes; leave it None")
        names = ("replicate", "shard") if len(shape) == 2 else None
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    if mesh.size() != world_size:
        raise ValueError(
            f"the device mesh has {mesh.size()} ranks but the job has {world_size}; veScale-FSDP shards over all ranks"
        )
    return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dims the strategy shards over: all but ``"tensor_parallel"`` (which the model's own
    ``parallelize_module`` uses)."""
    names = mesh.mesh_dim_names or ()
    if TENSOR_PARALLEL not in names:
        return mesh
    return mesh[tuple(name for name in names if name != TENSOR_PARALLEL)]


def data_parallel_sampler_kwargs(mesh: DeviceMesh) -> dict[str, int]:
    """A DistributedSampler's ``num_replicas`` / ``rank`` over the data-parallel ranks: the ranks
    of one tensor-parallel group read the same batch."""
    dp_mesh = data_parallel_mesh(mesh)
    rank = 0
    for dim in range(dp_mesh.ndim):
        rank = rank * dp_mesh.size(dim) + dp_mesh.get_local_rank(dim)
    return {"num_replicas": dp_mesh.size(), "rank": rank}

"""What the Trainer's strategy and Fabric's have in common: their configuration, checked when
they are built, and the processes and device mesh they set up (a mixin placed before
Lightning's ``ParallelStrategy``, whose abstract members it supplies)."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

from vescale_plugins import BlockSizeFn, QuantizedComm

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment

from . import processes
from .activation_checkpointing import ActivationCheckpointingPolicy, LayerCheckpointing
from .fsdp_arguments import resolve_mesh_request, sharding_strategy_in_force, translate_fsdp_arguments
from .options import (
    DeviceMeshRequest,
    ShardingOptions,
    StateDictType,
    WrapPolicy,
    build_device_mesh,
    check_device_mesh,
    check_parallel_sizes,
    check_state_dict_type,
    data_parallel_sampler_kwargs,
)

__all__ = ["VeScaleFSDPCommon", "shadow_fsdp1_members"]


class VeScaleFSDPCommon:
    # Each strategy's: its Lightning launcher class, and when its device mesh comes to exist.
    _launcher_class: type
    _mesh_exists: str
    parallel_devices: list[torch.device] | None

    if TYPE_CHECKING:
        # What Lightning's ParallelStrategy (placed after this mixin) provides.
        cluster_environment: ClusterEnvironment | None
        num_nodes: int

        @property
        def local_rank(self) -> int: ...
        @property
        def node_rank(self) -> int: ...
        @property
        def global_rank(self) -> int: ...
        @property
        def world_size(self) -> int: ...

    def _configure(
        self,
        process_group_backend: str | None,
        timeout: timedelta | None,
        auto_wrap_policy: WrapPolicy,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy | None,
        block_size_fn: BlockSizeFn | None,
        state_dict_type: StateDictType,
        device_mesh: DeviceMeshRequest,
        activation_checkpointing_policy: ActivationCheckpointingPolicy,
        find_unused_parameters: bool,
        data_parallel_size: int | Literal["auto"],
        tensor_parallel_size: int,
        cpu_offload: Any = None,
        *,
        sharding_strategy: str | ShardingStrategy | None = None,
        mixed_precision: MixedPrecision | None = None,
        activation_checkpointing: Any = None,
        fsdp1_kwargs: dict[str, Any] | None = None,
        comm_policy: QuantizedComm | None = None,
    ) -> None:
        """Check and keep the strategy's arguments. Called first in ``__init__``: a bad
        configuration fails in ``Trainer(...)`` / ``Fabric(...)``, before any process starts.

        ``sharding_strategy``, ``mixed_precision``, ``activation_checkpointing`` and
        ``fsdp1_kwargs`` are Lightning ``FSDPStrategy``'s, mapped onto ours (``fsdp_arguments``)."""
        check_device_mesh(device_mesh)
        check_parallel_sizes(data_parallel_size, tensor_parallel_size, device_mesh)
        fsdp = translate_fsdp_arguments(
            type(self).__name__,
            sharding_strategy=sharding_strategy,
            reshard_after_forward=reshard_after_forward,
            device_mesh=device_mesh,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            mixed_precision=mixed_precision,
            mp_policy=mp_policy,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_policy=activation_checkpointing_policy,
            kwargs=fsdp1_kwargs or {},
        )
        self._layer_checkpointing = LayerCheckpointing.from_policy(fsdp.activation_checkpointing_policy)
        self._sharding = ShardingOptions.from_arguments(
            auto_wrap_policy,
            fsdp.reshard_after_forward,
            fsdp.mp_policy,
            block_size_fn,
            find_unused_parameters,
            cpu_offload,
            sync_module_states=fsdp.sync_module_states,
            forward_prefetch=fsdp.forward_prefetch,
            backward_prefetch=fsdp.backward_prefetch,
            ignored=fsdp.ignored,
            comm_policy=comm_policy,
        )
        check_state_dict_type(state_dict_type)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._state_dict_type = state_dict_type
        self._device_mesh_request = fsdp.device_mesh
        self._parallel_sizes = (data_parallel_size, tensor_parallel_size)
        self._device_mesh: DeviceMesh | None = None
        # Lightning's FSDPStrategy exposes these: code that reads them gets the values in force.
        self.sharding_strategy = sharding_strategy_in_force(
            sharding_strategy, self._sharding.reshard_after_forward, fsdp.device_mesh
        )
        self.mixed_precision = mixed_precision
        self.cpu_offload = CPUOffload(offload_params=self._sharding.offload_policy is not None)

    @property
    def mixed_precision_config(self) -> MixedPrecision:
        """Lightning's FSDPStrategy names its mixed-precision setting so (FSDP1's ``MixedPrecision``):
        the policy in force (``mp_policy``), in those terms."""
        policy: MixedPrecisionPolicy = self.mp_policy  # type: ignore[attr-defined]  # each strategy defines mp_policy
        return MixedPrecision(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(f"the device mesh exists once the processes are {self._mesh_exists}")
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._device_mesh is not None:
            return data_parallel_sampler_kwargs(self._device_mesh)
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            processes.STRATEGY_NAME, cls, description=processes.STRATEGY_DESCRIPTION, override=True
        )

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Also when processes are created externally (every rank but 0 under Lightning's own
        # launcher, all of them under torchrun): the launcher sets each rank's torch threads
        # (as DDP's does), else ranks > 0 oversubscribe the CPU with the default thread count.
        self._launcher = self._launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        processes.set_world_ranks(
            self.cluster_environment, self.node_rank, self.local_rank, self.num_processes, self.num_nodes
        )

    def _set_up_processes(self) -> None:
        """This rank's place in the world, the default process group (unless it exists) and the mesh."""
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = processes.init_process_group(
            self.cluster_environment, self.root_device, self._process_group_backend, self._timeout
        )
        request = resolve_mesh_request(self._device_mesh_request, self.num_nodes, self.world_size)
        self._device_mesh = build_device_mesh(request, self.world_size, self.root_device, *self._parallel_sizes)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        processes.barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return processes.broadcast(obj, src)


def shadow_fsdp1_members(cls: type, fsdp_strategy: type, base: type) -> type:
    """Make ``cls``, a subclass of Lightning's ``fsdp_strategy``, never run FSDP1 code.

    Our strategies subclass Lightning's ``FSDPStrategy`` so that the ``isinstance(strategy,
    FSDPStrategy)`` checks in Lightning and in trainers (LitGPT's checkpoint loading and
    weight init) take their FSDP branch, which is the right one for a sharded model. Every
    member ``FSDPStrategy`` defines and ``cls`` does not define itself is taken from ``base``
    (Lightning's ``ParallelStrategy``, what the strategy was before), or, where ``base`` has
    no such member (FSDP1-only helpers), replaced by one that raises. For the same reason
    the strategies call ``ParallelStrategy``'s methods by name, never through ``super()``
    (which would reach ``FSDPStrategy``'s).
    """
    ours = {name for klass in cls.__mro__[: cls.__mro__.index(fsdp_strategy)] for name in vars(klass)}
    for name in vars(fsdp_strategy):
        if name in ours or name in _NOT_MEMBERS:
            continue
        try:
            setattr(cls, name, inspect.getattr_static(base, name))
        except AttributeError:
            setattr(cls, name, _fsdp1_only(fsdp_strategy, name))
    return cls


# Class bookkeeping, not behaviour.
_NOT_MEMBERS = frozenset({"__abstractmethods__", "__annotations__", "__doc__", "__module__", "_abc_impl", "__init__"})


def _fsdp1_only(fsdp_strategy: type, name: str) -> Any:
    def fsdp1_only(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{fsdp_strategy.__module__}.{fsdp_strategy.__name__}.{name} runs FSDP1; {type(self).__name__} "
            "(veScale-FSDP) has no such step"
        )

    return fsdp1_only

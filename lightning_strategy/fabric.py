"""``VeScaleFSDPFabricStrategy``: veScale-FSDP for Lightning Fabric, registered as ``"vescale_fsdp"``.

``fabric.setup(model, optimizer)`` / ``setup_module`` shard the model in place through the
core (the same units and arguments as the Trainer strategy); an optimizer set up together
with the model is pointed at the sharded parameters. ``no_backward_sync`` switches the
units' gradient reduction off, ``clip_gradients`` clips by the global norm of the DTensor
gradients, ``save`` / ``load`` write and read sharded or full checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.fsdp import FSDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from vescale_plugins import BlockSizeFn, QuantizedComm
from vescale_plugins.checkpoint import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from vescale_plugins.wrap import is_sharded

from . import checkpoints, processes
from .activation_checkpointing import ActivationCheckpointingPolicy
from .common import VeScaleFSDPCommon, shadow_fsdp1_members
from .model_setup import (
    gradient_sync_disabled,
    has_meta_tensors,
    parameter_names,
    rebind_optimizers,
    reshard_all,
    shard_for_training,
)
from .options import (
    DeviceMeshRequest,
    StateDictType,
    WrapPolicy,
    data_parallel_mesh,
)
from .precision import VeScaleFSDPFabricPrecision, as_vescale_precision
from .torch_fsdp_routing import refuse_torch_fsdp2_units, torch_fully_shard_routed

__all__ = ["VeScaleFSDPFabricStrategy"]


class VeScaleFSDPFabricStrategy(VeScaleFSDPCommon, FSDPStrategy):
    """Fully sharded data parallel training with veScale-FSDP, for Fabric.

    Takes the same sharding arguments as :class:`~lightning_strategy.VeScaleFSDPStrategy`
    (``auto_wrap_policy``, ``reshard_after_forward``, ``mp_policy``, ``block_size_fn``,
    ``comm_policy``, ``state_dict_type``, ``device_mesh``, ``activation_checkpointing_policy``,
    ``find_unused_parameters``, ``data_parallel_size``, ``tensor_parallel_size``,
    ``cpu_offload``) and the rest of Lightning ``FSDPStrategy``'s (``mixed_precision``,
    ``activation_checkpointing``, ``sharding_strategy``, FSDP1's keywords), of which it is a
    subclass so that ``isinstance(strategy, FSDPStrategy)`` checks take their FSDP branch. Call the
    model's ``forward`` (``model(x)``): that is where each unit gathers its parameters.

    Tensor parallelism as with Fabric's ``ModelParallelStrategy``: ``parallelize_fn(module,
    device_mesh)`` runs in ``setup_module`` before sharding (e.g. ``parallelize_module`` on
    ``device_mesh["tensor_parallel"]``) and returns the module; the strategy then shards it over
    the data-parallel dims (it may apply ``vescale_plugins.fully_shard`` itself on
    ``device_mesh["data_parallel"]``: those units stand; torch's ``fully_shard`` called there
    runs ours, see :mod:`lightning_strategy.torch_fsdp_routing`).
    """

    _launcher_class = _SubprocessScriptLauncher
    _mesh_exists = "launched (fabric.launch())"

    def __init__(
        self,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | CPUOffloadPolicy | None = None,
        mixed_precision: MixedPrecision | None = None,
        auto_wrap_policy: WrapPolicy = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: ActivationCheckpointingPolicy = None,
        sharding_strategy: str | ShardingStrategy | None = None,
        state_dict_type: StateDictType = "sharded",
        device_mesh: DeviceMeshRequest = None,
        reshard_after_forward: bool | int | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
        block_size_fn: BlockSizeFn | None = None,
        find_unused_parameters: bool = False,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
        comm_policy: QuantizedComm | None = None,
        **kwargs: Any,
    ) -> None:
        self._configure(
            process_group_backend,
            timeout,
            auto_wrap_policy,
            reshard_after_forward,
            mp_policy,
            block_size_fn,
            state_dict_type,
            device_mesh,
            activation_checkpointing_policy,
            find_unused_parameters,
            data_parallel_size,
            tensor_parallel_size,
            cpu_offload,
            sharding_strategy=sharding_strategy,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            fsdp1_kwargs=kwargs,
            comm_policy=comm_policy,
        )
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(
                f"parallelize_fn must be a function (module, device_mesh) -> module, got {parallelize_fn!r}"
            )
        # Not FSDPStrategy.__init__ (FSDP1's configuration): the strategy is a ParallelStrategy.
        ParallelStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._num_nodes = 1
        self._parallelize_fn = parallelize_fn
        self._backward_sync_control = _NoBackwardSync()

    # -- configuration -------------------------------------------------------------------

    @property  # type: ignore[override]  # ours, not FSDP1's FSDPPrecision
    def precision(self) -> VeScaleFSDPFabricPrecision:
        if self._precision is None:
            self._precision = VeScaleFSDPFabricPrecision()
        return self._precision  # type: ignore[return-value]  # only ever ours (here or via as_vescale_precision in the setter); the base types it as the base class

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Fabric builds a stock plugin from `precision=` and sets it here: translate it (or fail).
        self._precision = None if precision is None else as_vescale_precision(precision, VeScaleFSDPFabricPrecision)

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The mixed-precision policy units are sharded with: the explicit one, else the precision's."""
        return self._sharding.mp_policy or self.precision.mp_policy

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    # -- processes -----------------------------------------------------------------------

    def _set_world_ranks(self) -> None:
        # Fabric's connector calls this on strategies that have it (DDP, FSDP) once they are configured.
        self.set_world_ranks()

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # not super(): that is FSDPStrategy, FSDP1
        reset_seed()
        self._set_up_processes()

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return processes.all_reduce(tensor, group, reduce_op)

    # -- the model -----------------------------------------------------------------------

    def setup_module(self, module: nn.Module) -> nn.Module:
        self._checkpoint_layers(module)
        if self._parallelize_fn is not None:
            refuse_torch_fsdp2_units(module, "before fabric.setup")
            # A parallelize_fn written for ModelParallelStrategy (LitGPT's LoRA recipe) calls
            # torch's fully_shard: it runs ours, on the same mesh and arguments.
            with torch_fully_shard_routed("parallelize_fn"):
                module = self._parallelize_fn(module, self.device_mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return the nn.Module, got {type(module).__name__}")
        return shard_for_training(
            module,
            self._sharding,
            mesh=data_parallel_mesh(self.device_mesh),
            device=self.root_device,
            mp_policy=self.mp_policy,
        )

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Shard the model, then point the optimizers (built over the unsharded parameters) at the shards."""
        self._checkpoint_layers(module)  # first: the wrappers are part of the parameters' names
        names = parameter_names(module)
        module = self.setup_module(module)
        rebind_optimizers(optimizers, names, module)
        return module, optimizers, scheduler

    def _checkpoint_layers(self, module: nn.Module) -> None:
        # Once per module: setup_module_and_optimizers calls setup_module after wrapping.
        if self._layer_checkpointing is not None and not getattr(module, "_vescale_layers_checkpointed", False):
            self._layer_checkpointing.apply(module)
            # torch types Module.__setattr__'s value as a tensor or module; any value is allowed.
            module._vescale_layers_checkpointed = True  # type: ignore[assignment]

    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta_tensors(module):  # meta tensors are materialised on the device after sharding
            module.to(self.root_device)

    def module_sharded_context(self) -> AbstractContextManager:
        # Fabric's deprecated sharded_model(): sharding happens in setup_module, nothing to do here.
        return nullcontext()

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        # With empty_init the model is built on the meta device; setup shards it, then each rank
        # allocates and initialises only its shards.
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global norm over all ranks' shards; returns that norm as a plain tensor."""
        norm = ParallelStrategy.clip_gradients_norm(self, module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # -- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Sharded: a directory (shards through DCP, other entries in ``meta.pt``). Full: one file from rank 0.

        ``state`` holds one sharded model, its optimizers and any picklable or stateful metadata.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not support storage_options")
        path = Path(self.broadcast(path))  # every rank writes to rank 0's path
        module_key, module = _sharded_module(state)
        reshard_all(module)
        optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
        metadata = {key: _state_of(obj) for key, obj in state.items() if key != module_key and key not in optimizers}
        if self._state_dict_type == "sharded":
            if filter is not None:
                raise NotImplementedError(
                    "filter= needs state_dict_type='full': a sharded checkpoint stores whole state dicts"
                )
            optimizer = checkpoints.single_optimizer(list(optimizers.values()))
            checkpoints.save_sharded_checkpoint(
                path, module, optimizer, metadata, is_global_zero=self.is_global_zero, broadcast=self.broadcast
            )
            return
        full: dict[str, Any] = {module_key: full_model_state_dict(module)}
        full.update({key: full_optimizer_state_dict(module, optimizer) for key, optimizer in optimizers.items()})
        full.update(metadata)
        for key, keep in (filter or {}).items():
            if isinstance(full.get(key), dict):
                full[key] = {name: value for name, value in full[key].items() if keep(name, value)}
        checkpoints.save_full_checkpoint(path, full, is_global_zero=self.is_global_zero, broadcast=self.broadcast)

    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load either format into the objects in ``state`` (in place); return what was not asked for.

        ``state`` may also be a bare module (``fabric.load_raw``): the file must then be a full
        model state dict, e.g. saved from a plain model.
        """
        path = Path(self.broadcast(path))
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "load an optimizer together with its model: fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        if isinstance(state, nn.Module):
            if not checkpoints.is_full_checkpoint(path):
                raise ValueError(f"load_raw needs a file holding a full model state dict; {str(path)!r} is not a file")
            reshard_all(state)
            load_full_model_state_dict(state, checkpoints.load_file(path, weights_only), strict=strict)
            return {}
        if not state:
            raise ValueError(
                "pass the objects to load into: fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        module_key, module = _sharded_module(state)
        reshard_all(module)
        optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
        if checkpoints.is_sharded_checkpoint(path):
            optimizer = checkpoints.single_optimizer(list(optimizers.values()))
            metadata = checkpoints.load_sharded_checkpoint(path, module, optimizer, weights_only)
        elif checkpoints.is_full_checkpoint(path):
            metadata = checkpoints.load_file(path, weights_only)
            load_full_model_state_dict(module, metadata.pop(module_key), strict=strict)
            for key, optimizer in optimizers.items():
                state_of_optimizer = metadata.pop(key)
                checkpoints.check_optimizer_state_keys(state_of_optimizer)
                load_full_optimizer_state_dict(module, optimizer, state_of_optimizer)
        else:
            raise FileNotFoundError(
                f"{str(path)!r} is not a checkpoint: expected a sharded checkpoint directory or a full checkpoint file"
            )
        return _restore_metadata(state, metadata, exclude={module_key, *optimizers}, strict=strict)


class _NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: accumulate gradients locally, reduce on the next synced backward."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return gradient_sync_disabled(module) if enabled else nullcontext()


def _sharded_module(state: dict[str, Any]) -> tuple[str, nn.Module]:
    found = [(key, obj) for key, obj in state.items() if isinstance(obj, nn.Module) and is_sharded(obj)]
    if len(found) != 1:
        raise ValueError(
            "the checkpoint state must hold exactly one model set up with the vescale_fsdp strategy, found "
            f"{len(found)}{': ' + ', '.join(key for key, _ in found) if found else ''}; "
            "save each sharded model to its own path"
        )
    return found[0]


def _state_of(obj: Any) -> Any:
    """Metadata entries: stateful objects (e.g. an LR scheduler, a plain module) by their state dict."""
    return obj.state_dict() if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") else obj


def _restore_metadata(
    state: dict[str, Any], metadata: dict[str, Any], exclude: set[str], strict: bool
) -> dict[str, Any]:
    """Put each requested metadata entry back into ``state``; return the entries nobody asked for."""
    requested = [key for key in state if key not in exclude]
    missing = [key for key in requested if key not in metadata]
    if missing and strict:
        raise KeyError(f"the checkpoint has no entry for {missing}; pass strict=False to load the rest")
    for key in requested:
        if key not in metadata:
            continue
        value = metadata.pop(key)
        target = state[key]
        if hasattr(target, "load_state_dict") and hasattr(target, "state_dict"):
            target.load_state_dict(value)
        else:
            state[key] = value
    return metadata


shadow_fsdp1_members(VeScaleFSDPFabricStrategy, FSDPStrategy, ParallelStrategy)

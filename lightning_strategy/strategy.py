"""``VeScaleFSDPStrategy``: veScale-FSDP for Lightning's Trainer, registered as ``"vescale_fsdp"``.

A thin adapter, modelled on Lightning's ``ModelParallelStrategy`` (FSDP2) but without asking
the user to write ``configure_model``: ``setup`` shards the LightningModule in place through
``vescale_plugins.wrap.shard_model`` (every block of every ``nn.ModuleList``, or the layer
classes named in ``auto_wrap_policy``, then the LightningModule itself as the root unit).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.fsdp import FSDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
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
from .model_setup import gradient_sync_disabled, reshard_all, shard_for_training
from .options import (
    DeviceMeshRequest,
    StateDictType,
    WrapPolicy,
    data_parallel_mesh,
)
from .precision import VeScaleFSDPPrecision, as_vescale_precision
from .torch_fsdp_routing import torch_fully_shard_routed

__all__ = ["VeScaleFSDPStrategy"]


class VeScaleFSDPStrategy(VeScaleFSDPCommon, FSDPStrategy):
    """Fully sharded data parallel training with veScale-FSDP (RaggedShard parameters, flat buffers).

    Args:
        auto_wrap_policy: Which modules become units. ``None``: every block of every
            ``nn.ModuleList``. A set of layer classes (types or class names; torch's
            ``ModuleWrapPolicy`` too), as Lightning's ``FSDPStrategy`` takes, or a function
            ``model -> list[nn.Module]``. The LightningModule is always the root unit. If
            ``configure_model`` already applied ``vescale_plugins.fully_shard``, those units stand.
        reshard_after_forward: ``fully_shard``'s argument: free each unit's gathered parameters
            after its forward (``None``: every unit but the root; an int ``k``: keep each unit
            sharded over groups of ``k`` ranks until backward).
        mp_policy: ``fully_shard``'s mixed-precision policy; by default derived from the
            Trainer's ``precision`` ("32-true", "bf16-mixed" or "bf16-true").
        block_size_fn: ``fully_shard``'s ``(name, param) -> rows``: keep blocks of rows whole on one rank.
        comm_policy: ``fully_shard``'s ``comm_policy``: a ``vescale_plugins.QuantizedComm`` gathers
            the weights (and optionally reduces the gradients) as int8 blocks; ``None``: exact.
        state_dict_type: ``"sharded"``: checkpoints are directories each rank writes its shards
            into, loadable at any world size. ``"full"``: rank 0 writes one file with full
            tensors that a plain, unsharded model loads.
        device_mesh: A 1-D ``DeviceMesh`` over all ranks (or its shape ``(world_size,)``), or a
            2-D one ``(replicas, shard_size)`` for hybrid sharding (replicate across, shard
            within, as Lightning's FSDPStrategy takes it); default: one 1-D mesh is built. A
            DeviceMesh with a ``"tensor_parallel"`` dim: the strategy shards over the other dims.
        data_parallel_size, tensor_parallel_size: As Lightning's ``ModelParallelStrategy``: the
            mesh is ``(data_parallel_size, tensor_parallel_size)`` with dims named
            ``("data_parallel", "tensor_parallel")``; ``configure_model`` applies tensor
            parallelism with ``parallelize_module(..., self.device_mesh["tensor_parallel"], plan)``
            and the strategy shards over ``"data_parallel"`` (the DistributedSampler too).
            Defaults: ``tensor_parallel_size=1`` (no tensor parallelism, unlike
            ModelParallelStrategy's ``"auto"``), ``data_parallel_size="auto"`` (the rest).
        activation_checkpointing_policy: As Lightning's ``FSDPStrategy``: a set of layer classes
            (types or class names), torch's ``ModuleWrapPolicy`` or an FSDP1-style predicate; those
            modules are wrapped in torch's ``checkpoint_wrapper`` (activations recomputed in
            backward) before sharding. Checkpointing inside the model (``torch.utils.checkpoint``,
            Hugging Face's ``gradient_checkpointing_enable()``) needs no option.
        find_unused_parameters: Accepted as DDP's, for code that passes it: veScale-FSDP always
            handles data-dependent routing (a parameter that gets a gradient on some ranks only
            gets the reduced gradient on every rank; see ``set_find_unused_parameters``).
        cpu_offload: As Lightning's ``FSDPStrategy``: ``True`` or FSDP1's
            ``CPUOffload(offload_params=True)`` keeps the sharded parameters, their gradients and
            the optimizer step on the CPU (FSDP2's ``CPUOffloadPolicy()``, which may also be
            passed, e.g. with ``pin_memory=False``); the forward and backward run on the device.
        process_group_backend, timeout: as for Lightning's other distributed strategies.
        mixed_precision, activation_checkpointing, sharding_strategy, **kwargs: the rest of
            Lightning ``FSDPStrategy``'s signature (FSDP1's ``MixedPrecision``, the older name of
            ``activation_checkpointing_policy``, FSDP1's sharding strategies as meshes and
            ``reshard_after_forward``, FSDP1's constructor keywords), mapped or accepted as
            ``lightning_strategy.fsdp_arguments`` and ``docs/lightning.md`` say.

    A subclass of Lightning's ``FSDPStrategy``, so that ``isinstance(strategy, FSDPStrategy)``
    checks take their FSDP branch; none of its FSDP1 code runs (``shadow_fsdp1_members``).
    """

    strategy_name = processes.STRATEGY_NAME
    _registered_strategies: list[str] = [processes.STRATEGY_NAME]  # FSDPStrategy's name for it
    _launcher_class = _SubprocessScriptLauncher
    _mesh_exists = "set up (Trainer.fit / validate / ...)"

    def __init__(
        self,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
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
        self._checkpointed_model: torch.nn.Module | None = None
        # Not FSDPStrategy.__init__ (FSDP1's configuration): the strategy is a ParallelStrategy.
        ParallelStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1

    # -- configuration -------------------------------------------------------------------

    @classmethod
    def get_registered_strategies(cls) -> list[str]:
        return list(cls._registered_strategies)

    @property  # type: ignore[override]  # ours, not FSDP1's FSDPPrecision
    def precision_plugin(self) -> VeScaleFSDPPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = VeScaleFSDPPrecision()
        return self._precision_plugin  # type: ignore[return-value]  # only ever ours (here or via as_vescale_precision in the setter); the base types it as the base class

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The Trainer builds a stock plugin from `precision=` and sets it here: translate it (or fail).
        self._precision_plugin = None if plugin is None else as_vescale_precision(plugin, VeScaleFSDPPrecision)

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The mixed-precision policy units are sharded with: the explicit one, else the precision's."""
        return self._sharding.mp_policy or self.precision_plugin.mp_policy

    @property
    def state_dict_type(self) -> StateDictType:
        return self._state_dict_type

    @property
    def is_distributed(self) -> bool:
        # Read by the Trainer for custom strategies: enables the DistributedSampler and sync_dist.
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints are loaded into the sharded model and its optimizer, so after setup.
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer state itself

    # -- processes -----------------------------------------------------------------------

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # not super(): that is FSDPStrategy, FSDP1
        reset_seed()
        self._set_up_processes()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # `self.device_mesh` in configure_model

    def reduce(
        self,
        tensor: torch.Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Any:
        return processes.all_reduce(tensor, group, reduce_op)

    # -- the model -----------------------------------------------------------------------

    def connect(self, model: LightningModule) -> None:
        ParallelStrategy.connect(self, model)
        if not is_overridden("configure_model", model) and not is_sharded(model):
            # The model is complete already: check the wrap policy before any process group exists.
            self._sharding.units(model)

    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if self._layer_checkpointing is not None and self.model is not self._checkpointed_model:
            self._layer_checkpointing.apply(self.model)
            self._checkpointed_model = self.model  # set up again (fit, then test): wrapped already
        self.model = shard_for_training(
            self.model,
            self._sharding,
            mesh=data_parallel_mesh(self.device_mesh),
            device=self.root_device,
            mp_policy=self.mp_policy,
        )
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: Trainer) -> None:
        # A model set up again (fit, then test) gets fresh optimizers over its sharded parameters.
        self._reset_optimizers_and_schedulers()
        ParallelStrategy.setup_optimizers(self, trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Lightning calls configure_model inside it: torch's fully_shard there (a model written
        # for ModelParallelStrategy) runs ours.
        with torch_fully_shard_routed("configure_model"):
            yield

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # With empty_init the model is built on the meta device; setup shards it, then each rank
        # allocates and initialises only its shards.
        device = torch.device("meta") if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: backward keeps gradients local, no reduce-scatter."""
        assert self.model is not None
        with gradient_sync_disabled(self.model):
            yield

    # The LightningModule is the root unit, but the loops call its *_step methods, not forward.
    # Route them through forward (Lightning's forward redirection, as for its FSDP1/DeepSpeed
    # wrappers) so the root's hooks gather its parameters and set up its backward.

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_root_forward("training_step", self.precision_plugin.train_step_context, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_root_forward("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_root_forward("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_root_forward("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _through_root_forward(
        self, method_name: str, step_context: Callable[[], Any], args: tuple, kwargs: dict
    ) -> Any:
        assert self.model is not None and self.lightning_module is not None
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with step_context():
            return self._forward_redirection(self.model, self.lightning_module, method_name, *args, **kwargs)

    # Without grad the root keeps its parameters gathered after forward; free them after evaluation.

    def on_validation_end(self) -> None:
        assert self.model is not None
        reshard_all(self.model)

    def on_test_end(self) -> None:
        assert self.model is not None
        reshard_all(self.model)

    def on_predict_end(self) -> None:
        assert self.model is not None
        reshard_all(self.model)

    def teardown(self) -> None:
        # Not Strategy.teardown: it would move the sharded model to the CPU.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints ---------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: the DTensor state dict (no communication). Full: full CPU tensors on rank 0, {} elsewhere."""
        assert self.model is not None
        reshard_all(self.model)
        if self._state_dict_type == "full":
            return full_model_state_dict(self.model)
        return self.model.state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded: this rank's optimizer state (save_checkpoint writes it through DCP). Full: gathered on rank 0."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        if self._state_dict_type == "full":
            return full_optimizer_state_dict(self.model, optimizer)
        return optimizer.state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model already

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded the optimizer already

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Sharded: a directory (shards through DCP + ``meta.pt``). Full: one file from rank 0."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not support storage_options")
        path = Path(self.broadcast(filepath))  # every rank writes to rank 0's path
        if self._state_dict_type == "full":
            checkpoints.save_full_checkpoint(
                path,
                checkpoint,
                is_global_zero=self.is_global_zero,
                broadcast=self.broadcast,
                write=self.checkpoint_io.save_checkpoint,
            )
            return
        assert self.model is not None
        # The state dicts in `checkpoint` are rank-local views; DCP writes the shards from the objects.
        metadata = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        # A weights-only checkpoint (ModelCheckpoint(save_weights_only=True)) has no optimizer states.
        optimizer = checkpoints.single_optimizer(self.optimizers) if "optimizer_states" in checkpoint else None
        checkpoints.save_sharded_checkpoint(
            path, self.model, optimizer, metadata, is_global_zero=self.is_global_zero, broadcast=self.broadcast
        )

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load either format into the sharded model (and, when fitting, its optimizer); return the rest."""
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        reshard_all(self.model)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if checkpoints.is_sharded_checkpoint(path):
            optimizer = checkpoints.single_optimizer(self.optimizers) if fitting else None
            return checkpoints.load_sharded_checkpoint(path, self.model, optimizer, weights_only)
        if not checkpoints.is_full_checkpoint(path):
            raise FileNotFoundError(
                f"{str(path)!r} is not a checkpoint: expected a sharded checkpoint directory or a full checkpoint file"
            )
        checkpoint = checkpoints.load_file(path, weights_only)
        strict = self.lightning_module.strict_loading
        load_full_model_state_dict(self.model, checkpoint.pop("state_dict"), strict=strict)
        optimizer_states = checkpoint.get("optimizer_states")
        if fitting and optimizer_states is not None:
            if len(optimizer_states) != len(self.optimizers):
                raise RuntimeError(
                    f"the checkpoint holds {len(optimizer_states)} optimizer states but the LightningModule "
                    f"configures {len(self.optimizers)} optimizers"
                )
            for optimizer, state in zip(self.optimizers, optimizer_states):
                checkpoints.check_optimizer_state_keys(state)
                load_full_optimizer_state_dict(self.model, optimizer, state)
        return checkpoint


shadow_fsdp1_members(VeScaleFSDPStrategy, FSDPStrategy, ParallelStrategy)

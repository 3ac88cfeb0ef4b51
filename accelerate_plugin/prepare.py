"""What Accelerate's ``fsdp2_prepare_model`` does, with ``vescale_plugins`` doing the sharding.

Accelerate calls this from ``Accelerator.prepare`` (and ``_prepare_fsdp2`` re-points the
optimizer at the sharded parameters by name afterwards). The units are the modules
Accelerate's own FSDP2 auto-wrap predicate selects, so a policy means the same thing here
as under FSDP2; the sharding itself is ``vescale_plugins.wrap.shard_model``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_parameters_from_modules
from accelerate.utils.other import get_module_children_bottom_up
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from vescale_plugins import VeScaleFSDPModule
from vescale_plugins.observe.summary import sharding_summary
from vescale_plugins.wrap import materialize_meta_tensors, shard_model

from .full_state import load_model_from_rank0

__all__ = ["prepare_model"]


def prepare_model(accelerator: Any, model: nn.Module) -> nn.Module:
    """Shard ``model`` in place as the accelerator's :class:`VeScaleFSDPPlugin` asks; return it."""
    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    if accelerator.mixed_precision != "no":
        _upcast_trainable_params(model)
    ignored = None
    if plugin.ignored_modules is not None:
        ignored = get_parameters_from_modules(plugin.ignored_modules, model, accelerator.device)
    # Accelerate's meaning: only rank 0 loaded real weights (transformers leaves the other
    # ranks' uninitialised); after sharding, every rank gets rank 0's values.
    rank0_state = None
    if plugin.cpu_ram_efficient_loading:
        rank0_state = model.state_dict() if accelerator.is_main_process else {}
    shard_model(
        model,
        unit_fn=_units(fsdp2_prepare_auto_wrap_policy(plugin, model)),
        mesh=_mesh(accelerator),
        reshard_after_forward=plugin.reshard_after_forward,
        mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        block_size_fn=plugin.block_size_fn,
        comm_policy=plugin.comm_policy,
        ignored_params=ignored,
        offload_policy=plugin.cpu_offload,  # fsdp_offload_params: FSDP2's CPUOffloadPolicy, as Accelerate builds it
    )
    if rank0_state is not None:
        load_model_from_rank0(model, rank0_state)
    else:
        # Built on the meta device (``init_empty_weights``, ``torch.device("meta")``): each rank
        # allocates its shards and draws them with the modules' own reset_parameters(), as the
        # Lightning strategies do (FSDP2 under Accelerate would leave them on meta).
        uninitialised = materialize_meta_tensors(model, accelerator.device)
        if uninitialised:
            warnings.warn(
                "These modules were built on the meta device but define no reset_parameters(), so their "
                f"parameters and buffers hold uninitialised memory (load a checkpoint into them): {', '.join(uninitialised)}",
                stacklevel=2,
            )
    if plugin.resolve_find_unused_parameters(accelerator.ddp_handler):
        cast(VeScaleFSDPModule, model).set_find_unused_parameters(True)
    accelerator.print(sharding_summary(model))
    return model


def _units(policy: Callable[[nn.Module], bool] | None) -> Callable[[nn.Module], list[nn.Module]]:
    """The modules FSDP2 under Accelerate would ``fully_shard`` before the root, innermost first."""

    def select(model: nn.Module) -> list[nn.Module]:
        if policy is None:
            return []
        # A container without a forward (ModuleList) can never be a unit: no hook would run.
        # FSDP1's size policy skipped them; Accelerate's FSDP2 port would crash on them.
        chosen = [
            m
            for m in get_module_children_bottom_up(model)[:-1]
            if policy(m) and type(m).forward is not nn.Module.forward
        ]
        # Accelerate's predicate sees through an activation-checkpoint wrapper, so it matches
        # both the wrapper and the layer inside; the wrapper is the unit (its forward runs the
        # recomputation), the layer inside must not become a second, empty one.
        wrapped = {id(m._checkpoint_wrapped_module) for m in chosen if hasattr(m, "_checkpoint_wrapped_module")}
        return [m for m in chosen if id(m) not in wrapped]

    return select


def _mesh(accelerator: Any) -> DeviceMesh | None:
    """Accelerate's data-parallel mesh when a ``ParallelismConfig`` built one; else the world."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None:
        return None
    return mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]


def _upcast_trainable_params(model: nn.Module) -> None:
    # As Accelerate's FSDP2 path: with mixed precision the sharded master weights are fp32 and
    # the policy's param_dtype is the compute copy; a unit needs one dtype per buffer anyway.
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)

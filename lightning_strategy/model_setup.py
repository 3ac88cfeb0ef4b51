"""What both strategies do to the user's model: shard it through the core, and live with that.

``fully_shard`` works in place: the module keeps its identity (the LightningModule stays the
LightningModule) but its parameters are replaced by ``nn.Parameter(DTensor)`` objects. So an
optimizer built before sharding must be pointed at the new parameters, meta-device tensors
are materialised after sharding (each rank allocates only its shards), and gradient sync is
switched off through the FSDP2 method the sharded modules carry.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from vescale_plugins import VeScaleFSDPModule
from vescale_plugins.observe.summary import sharding_summary
from vescale_plugins.wrap import has_meta_tensors, is_sharded, materialize_meta_tensors, shard_model

from .options import ShardingOptions
from .torch_fsdp_routing import refuse_torch_fsdp2_units

__all__ = [
    "shard_for_training",
    "broadcast_module_states",
    "materialize",
    "parameter_names",
    "rebind_optimizers",
    "reshard_all",
    "gradient_sync_disabled",
    "has_meta_tensors",
]


def shard_for_training(
    module: nn.Module,
    options: ShardingOptions,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
) -> nn.Module:
    """Shard ``module`` on ``mesh`` and leave it on ``device``, ready to train; returns it.

    Nothing sharded yet: the policy's units, then the root. The user already sharded some
    modules (e.g. in ``configure_model``): their choice of units stands, only the root is
    added if missing. Meta-device tensors are materialised after sharding.
    """
    refuse_torch_fsdp2_units(module, "before the strategy set it up")
    if not isinstance(module, VeScaleFSDPModule):  # the root is not sharded yet
        # Resolve (and validate) the units before touching the module or the device.
        ignored = options.ignored_params()
        units = [] if is_sharded(module) else options.units(module)
        # FSDP1 wraps no ignored module: a unit with nothing left to shard is none.
        units = [u for u in units if any(p not in ignored for p in u.parameters())]
        if not has_meta_tensors(module):
            # Shard where the model will live: the DBuffers are allocated on the parameters' device.
            module.to(device)
            if options.sync_module_states:
                broadcast_module_states(module)
        shard_model(
            module,
            unit_fn=lambda _: units,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            mp_policy=mp_policy,
            block_size_fn=options.block_size_fn,
            comm_policy=options.comm_policy,
            offload_policy=options.offload_policy,
            ignored_params=ignored or None,
        )
    _set_prefetch(module, options)
    if options.find_unused_parameters:  # DDP's switch: data-dependent routing (MoE, conditional branches)
        cast(VeScaleFSDPModule, module).set_find_unused_parameters(True)
    materialize(module, device)
    rank_zero_info(sharding_summary(module))
    return module


def broadcast_module_states(module: nn.Module) -> None:
    """FSDP1's ``sync_module_states=True``: every rank starts from rank 0's parameters and buffers.

    Plain tensors only: DTensors (units the user sharded, tensor-parallel shards) hold each
    rank's own piece already.
    """
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor.data, src=0)


def _set_prefetch(module: nn.Module, options: ShardingOptions) -> None:
    """``forward_prefetch`` / ``backward_prefetch`` set to off: no unit starts another's all-gather."""
    for unit in module.modules():
        if isinstance(unit, VeScaleFSDPModule):
            if options.forward_prefetch is False:
                unit.set_modules_to_forward_prefetch([])
            if options.backward_prefetch is False:
                unit.set_modules_to_backward_prefetch([])


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate meta-device tensors on ``device`` and initialise them with ``reset_parameters()``
    (Lightning's rule, :func:`vescale_plugins.wrap.materialize_meta_tensors`); warn about
    modules that define none."""
    uninitialised = materialize_meta_tensors(module, device)
    if uninitialised:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            "These modules were built on the meta device but define no reset_parameters(), so their parameters "
            f"and buffers hold uninitialised memory (load a checkpoint into them): {', '.join(uninitialised)}"
        )


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``, taken before sharding to find each parameter's replacement after it."""
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


def rebind_optimizers(optimizers: Sequence[torch.optim.Optimizer], names: dict[int, str], module: nn.Module) -> None:
    """Point optimizers built before sharding at the sharded parameters that replaced their parameters."""
    current = dict(module.named_parameters(remove_duplicate=False))
    for optimizer in optimizers:
        if optimizer.state:
            raise RuntimeError(
                f"{type(optimizer).__name__} already has state (it took a step before setup); set up the model "
                "and optimizer before training, or create the optimizer after setting up the model"
            )
        for group in optimizer.param_groups:
            try:
                group["params"] = [current[names[id(p)]] for p in group["params"]]
            except KeyError:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a parameter that is not in the model being set up; "
                    "set up each optimizer together with the model whose parameters it updates"
                ) from None


def reshard_all(module: nn.Module) -> None:
    """Free every unit's gathered parameters so the module exposes its sharded DTensors again.

    The root unit keeps its parameters gathered after a forward without grad (evaluation), and
    while gathered its modules hold plain full tensors: state dicts must not see those.
    """
    for submodule in module.modules():
        if isinstance(submodule, VeScaleFSDPModule):
            submodule.reshard()


@contextmanager
def gradient_sync_disabled(module: nn.Module) -> Iterator[None]:
    """Backward accumulates gradients locally, without any reduce-scatter, inside this context."""
    sharded = [m for m in module.modules() if isinstance(m, VeScaleFSDPModule)]
    if not sharded:
        raise TypeError(f"{type(module).__name__} is not sharded: set it up with the vescale_fsdp strategy first")
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)

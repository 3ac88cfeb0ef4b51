"""Choosing FSDP units for a whole model, the way trainers ask for it.

Lightning and Accelerate both let a user name "the layer classes" (or nothing, and expect a
sensible default). This module turns that into ``fully_shard`` calls, bottom-up, so the
adapters hold no sharding logic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from vescale_plugins.runtime.api import BlockSizeFn, fully_shard

__all__ = [
    "default_units",
    "units_of_classes",
    "shard_model",
    "is_sharded",
    "has_meta_tensors",
    "materialize_meta_tensors",
]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``module`` or any module inside it."""
    return any(vars(m).get("_vescale_fsdp_unit") is not None for m in module.modules())


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every block of every ``nn.ModuleList`` in ``model`` (transformer layers), outermost lists first."""
    units: list[nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                if id(block) not in seen and not any(id(m) in seen for m in block.modules()):
                    units.append(block)
                    seen.update(id(m) for m in block.modules())
    return units


def units_of_classes(model: nn.Module, classes: Iterable[type[nn.Module] | str]) -> list[nn.Module]:
    """Modules of the given classes (or class names), skipping ones nested in an earlier match."""
    wanted = tuple(classes)
    names = {c for c in wanted if isinstance(c, str)}
    types = tuple(c for c in wanted if isinstance(c, type))
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if module is model or id(module) in inside:
            continue
        if isinstance(module, types) or type(module).__name__ in names:
            units.append(module)
            inside.update(id(m) for m in module.modules())
    if wanted and not units:
        present = sorted({type(m).__name__ for m in model.modules() if m is not model})
        asked = sorted(c if isinstance(c, str) else c.__name__ for c in wanted)
        raise ValueError(f"no module of class {asked} in {type(model).__name__}; it contains {present}")
    return units


def shard_model(
    model: nn.Module,
    *,
    unit_classes: Iterable[type[nn.Module] | str] | None = None,
    unit_fn: Callable[[nn.Module], list[nn.Module]] | None = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    block_size_fn: BlockSizeFn | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Shard ``model``: each unit (default: every ModuleList block), then the root.

    ``unit_classes`` names layer classes (types or names) as Lightning's and Accelerate's
    FSDP options do; ``unit_fn`` picks the units itself. A model whose units were already
    sharded by the user (e.g. in Lightning's ``configure_model``) is left as it is.
    """
    if vars(model).get("_vescale_fsdp_unit") is not None:
        return model
    if unit_fn is not None:
        units = unit_fn(model)
    elif unit_classes is not None:
        units = units_of_classes(model, unit_classes)
    else:
        units = default_units(model)
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        block_size_fn=block_size_fn,
        **fully_shard_kwargs,
    )
    for unit in units:
        if vars(unit).get("_vescale_fsdp_unit") is None:
            fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def materialize_meta_tensors(module: nn.Module, device: torch.device) -> list[str]:
    """Allocate ``module``'s meta-device tensors on ``device`` and initialise them with each
    module's ``reset_parameters()``, as Lightning's FSDP and ModelParallel strategies do:
    every submodule that holds parameters or buffers of its own and defines it, parents first.

    Per-module overrides are honoured (LitGPT replaces ``reset_parameters`` on its layers).
    On a sharded module each rank allocates and draws only its shards, the values a draw of
    the full tensor gives (the same as one process initialising the whole model with the
    same seed). Returns the class names of modules that hold tensors but define no
    ``reset_parameters`` (left uninitialised: the caller warns).
    """
    if not has_meta_tensors(module):
        return []
    module.to_empty(device=device)
    uninitialised = set()
    for submodule in module.modules():
        if next(itertools.chain(submodule.parameters(recurse=False), submodule.buffers(recurse=False)), None) is None:
            continue
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialised.add(type(submodule).__name__)
    return sorted(uninitialised)

"""One line that says veScale-FSDP is active: the engine, the units and the mesh.

Front ends print it once, on rank 0, after sharding, so a run that forgot to switch veScale
on (e.g. an Accelerate script started without ``-m accelerate_plugin.run``, which then
trains separate copies) is told apart from one that did by its log.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from vescale_plugins.runtime.module import VeScaleFSDPModule
from vescale_plugins.runtime.state import groups_under

__all__ = ["sharding_summary"]

_NAMES_SHOWN = 4


def sharding_summary(model: nn.Module) -> str:
    """``veScale-FSDP: <Model> sharded as N units [names] over a 1-D mesh of W ranks (backend)``."""
    units = groups_under([model])
    model_class = type(model).__name__
    if isinstance(model, VeScaleFSDPModule):  # the class fully_shard made: FSDP<original>
        model_class = type(model).__bases__[1].__name__
    if not units:
        return f"veScale-FSDP: {model_class} is not sharded"
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    labels = [",".join(names.get(id(m), type(m).__name__) for m in unit.modules) for unit in units]
    if len(labels) > _NAMES_SHOWN:
        labels = [*labels[: _NAMES_SHOWN - 1], "...", labels[-1]]
    mesh = units[0].mesh
    backend = dist.get_backend(units[0].group) if dist.is_initialized() else "no process group"
    return (
        f"veScale-FSDP: {model_class} sharded as {len(units)} unit{'s' if len(units) != 1 else ''} "
        f"[{', '.join(labels)}] over a 1-D {mesh.device_type} mesh of {mesh.size()} ranks ({backend})"
    )

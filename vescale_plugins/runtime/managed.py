"""One managed parameter's record, and the registry that routes assignments to its unit."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from vescale_plugins.runtime.tensor_parallel import ParallelSpec

if TYPE_CHECKING:
    from vescale_plugins.runtime.fsdp_unit import FSDPUnit

__all__ = ["ManagedParam", "track_slots"]


@dataclass
class ManagedParam:
    """One parameter of a unit: where it is registered, its sharded and unsharded faces."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    sharded: nn.Parameter
    buffer_index: int
    slot_index: int
    unsharded: nn.Parameter | None = None
    # The parameter fully_shard replaced, weakly: a module outside the unit still holding it
    # (a tied weight) is a parameter shared across units, which the outer unit must refuse.
    original: Any = None
    # Gradients of micro-batches that did not sync, in the reduce dtype when it differs from
    # the unsharded parameters' (FSDP2 accumulates there, not in bf16 on the parameter).
    accumulated_grad: torch.Tensor | None = None
    # Set when the parameter was already a DTensor (tensor/expert parallel, SPMD mesh): the
    # DBuffer holds its local tensor and the gathered parameter is that DTensor again.
    parallel: ParallelSpec | None = None

    def gathered_grad(self) -> torch.Tensor | None:
        """The gathered parameter's gradient as a local tensor (a TP DTensor's local shard)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None or self.parallel is None:
            return grad
        return self.parallel.local_grad(grad)

    def register(self, param: nn.Parameter) -> None:
        # Bypass nn.Module.__setattr__: the parameter changes identity every forward.
        for module, name in self.owners:
            module._parameters[name] = param


# Which (module, name) slots hold a managed parameter, so that assigning to one (meta-device
# init followed by ``module.w = nn.Parameter(t)``, ``load_state_dict(assign=True)``) lands
# in the unit's DBuffer instead of silently replacing the sharded parameter (FSDP2 adopts such
# assignments too).
_MANAGED_SLOTS: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[FSDPUnit, ManagedParam]]]" = weakref.WeakKeyDictionary()


def track_slots(unit: "FSDPUnit", managed: list[ManagedParam]) -> None:
    for m in managed:
        for module, name in m.owners:
            _MANAGED_SLOTS.setdefault(module, {})[name] = (unit, m)


def _adopt_assigned_parameter(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
    slots = _MANAGED_SLOTS.get(module)
    if not slots or name not in slots:
        return None
    unit, managed = slots[name]
    return unit.adopt_assigned(managed, param)


nn.modules.module.register_module_parameter_registration_hook(_adopt_assigned_parameter)

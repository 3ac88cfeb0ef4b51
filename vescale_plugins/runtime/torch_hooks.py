"""What ``fully_shard`` installs in torch, and the registry its one global hook reads.

Nothing here runs at import. :func:`install`, called by every ``fully_shard``, does once per
process (idempotent, under a lock):

- teaches DTensor the RaggedShard placement (:func:`vescale_plugins.ragged.dtensor.install`);
- registers one global module parameter-registration hook
  (``torch.nn.modules.module.register_module_parameter_registration_hook``). It answers only
  for the ``(module, name)`` slots that hold a sharded parameter (:func:`track_slots`):
  assigning to one (meta-device init followed by ``module.w = nn.Parameter(t)``,
  ``load_state_dict(assign=True)``) lands in the unit's DBuffer instead of silently
  replacing the sharded parameter, as FSDP2 adopts such assignments. Every other assignment
  returns ``None``, which torch reads as "unchanged".

The registry is keyed by module objects (weakly), never by process-wide state, so ranks run
as threads of one process keep theirs apart.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch.nn as nn

from vescale_plugins.ragged import dtensor

__all__ = ["install", "track_slots"]


class _Slotted(Protocol):
    @property
    def owners(self) -> Sequence[tuple[nn.Module, str]]: ...


P = TypeVar("P", bound=_Slotted)

# What to call when a managed (module, name) slot is assigned: the unit's ``adopt_assigned``
# and the sharded parameter the slot holds.
_MANAGED_SLOTS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[Callable[[Any, nn.Parameter], Any], Any]]] = (
    weakref.WeakKeyDictionary()
)
_INSTALL_LOCK = threading.Lock()
_installed = False


def install() -> None:
    """Install our torch patches and hook (see the module docstring); idempotent, thread-safe."""
    global _installed
    if _installed:
        return
    with _INSTALL_LOCK:
        if not _installed:
            dtensor.install()
            nn.modules.module.register_module_parameter_registration_hook(_adopt_assigned_parameter)
            _installed = True


def track_slots(adopt: Callable[[P, nn.Parameter], nn.Parameter | None], fsdp_params: Iterable[P]) -> None:
    """Route assignments to every owner slot of ``fsdp_params`` to ``adopt(fsdp_param, value)``
    (the unit's ``adopt_assigned``), whose answer torch registers instead of ``value``."""
    for fsdp_param in fsdp_params:
        for module, name in fsdp_param.owners:
            _MANAGED_SLOTS.setdefault(module, {})[name] = (adopt, fsdp_param)


def _adopt_assigned_parameter(module: nn.Module, name: str, param: nn.Parameter) -> Any:
    slots = _MANAGED_SLOTS.get(module)
    if not slots or name not in slots:
        return None
    adopt, fsdp_param = slots[name]
    return adopt(fsdp_param, param)

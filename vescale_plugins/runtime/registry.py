"""Every registry the runtime keeps across units, and the one global hook, in one place.

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

The registries:

* Which managed parameter a sharded face is (:func:`fsdp_param_of`, :func:`dbuffer_of`):
  optimizers ask which DBuffer a parameter views; set-up refuses a parameter already sharded.
* Which ``fully_shard`` call took each parameter (:func:`record_sharded`,
  :func:`sharded_by_another_call`): a module outside that unit still holding one (a weight
  tied across sibling units) would otherwise be sharded a second time into a separate,
  silently untied copy.
* Which ``(module, name)`` slots hold a managed parameter (:func:`track_slots`), read by the hook.

Each map is keyed by a parameter or a module, never by process-wide state (a process group,
a mesh, the current device), and holds its keys weakly: ranks run as threads of one process
(torch's ``MultiThreadedTestCase``) each have their own modules and parameters, so no entry
is shared between ranks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from vescale_plugins.dbuffer import DBuffer
from vescale_plugins.ragged import dtensor

__all__ = [
    "ManagedParameter",
    "install",
    "track_slots",
    "dbuffer_of",
    "fsdp_param_of",
    "record_sharded",
    "register_sharded_face",
    "sharded_by_another_call",
]


class ManagedParameter(Protocol):
    """What the registry knows of a managed parameter (``runtime.param.FSDPParam``)."""

    @property
    def sharded(self) -> torch.Tensor: ...

    @property
    def dbuffer(self) -> DBuffer: ...

    @property
    def owns_local(self) -> bool: ...


# The managed parameter of each sharded face, by the face's id. Not a weak reference to the
# parameter (``module._apply`` swaps a DTensor parameter's contents in place, which torch
# refuses for a weakly referenced tensor); the lookup checks identity, so a reused id never
# answers.
_BY_SHARDED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register_sharded_face(face: torch.Tensor, fsdp_param: ManagedParameter) -> None:
    """``face`` is ``fsdp_param``'s sharded face (made at ``fully_shard`` or replaced since)."""
    _BY_SHARDED[id(face)] = fsdp_param


def fsdp_param_of(param: torch.Tensor) -> Any:
    """The managed parameter (``FSDPParam``) whose sharded face ``param`` is, or ``None``."""
    fsdp_param = _BY_SHARDED.get(id(param))
    return fsdp_param if fsdp_param is not None and fsdp_param.sharded is param else None


def dbuffer_of(param: torch.Tensor) -> DBuffer | None:
    """The DBuffer whose sharded buffer ``param`` (a sharded parameter) is a view of, or
    ``None`` for any other tensor. A flat optimizer reads :meth:`DBuffer.sharded_padding`
    from it to step across the padding between parameters."""
    fsdp_param = fsdp_param_of(param)
    return fsdp_param.dbuffer if fsdp_param is not None and not fsdp_param.owns_local else None


# Every parameter a fully_shard call replaced, held weakly, with where it went.
_SHARDED_BY_ANOTHER_CALL: WeakIdKeyDictionary = WeakIdKeyDictionary()


def record_sharded(modules: Sequence[nn.Module], params: Sequence[tuple[str, nn.Parameter]]) -> None:
    """Remember which unit (of ``modules``) took each ``(name, parameter)``."""
    where = " + ".join(type(m).__name__ for m in modules)
    for fqn, param in params:
        _SHARDED_BY_ANOTHER_CALL[param] = f"{fqn!r} of the {where} unit"


def sharded_by_another_call(param: nn.Parameter) -> str | None:
    """Which earlier ``fully_shard`` call took ``param`` (``"'name' of the X unit"``), if any."""
    return _SHARDED_BY_ANOTHER_CALL.get(param)


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

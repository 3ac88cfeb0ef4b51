"""Which parameters a ``fully_shard`` call takes: those under its modules, except the ones a
unit inside them already manages and the subtrees another composable API manages (torch's
``replicate``), as FSDP2 collects them; and those it shares with a unit inside it (which
set-up refuses)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_common import _is_composable_with_fsdp

__all__ = ["FoundParam", "collect_params"]

FoundParam = tuple[str, list[tuple[nn.Module, str]], nn.Parameter]  # (fqn, owners, parameter)


def collect_params(modules: list[nn.Module], ignored: set[nn.Parameter]) -> tuple[list[FoundParam], list[str]]:
    """This unit's parameters ``(fqn, owners, parameter)``: those under ``modules`` not
    already managed by a unit inside them; and those shared with such a unit (refused)."""
    managed_below: dict[int, str] = {}
    for root in modules:
        for sub in root.modules():
            unit = vars(sub).get("_vescale_fsdp_unit")
            if unit is not None:
                for fsdp_param in unit.fsdp_params:
                    managed_below[id(fsdp_param.sharded)] = fsdp_param.fqn
                    original = fsdp_param.original()
                    if original is not None:
                        managed_below[id(original)] = fsdp_param.fqn
    found: dict[int, FoundParam] = {}
    shared_with_child: list[str] = []
    for root in modules:
        for module_name, module in root.named_modules(remove_duplicate=False):
            if _under_other_api(root, module_name):
                continue
            for name, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                fqn = f"{module_name}.{name}" if module_name else name
                if id(param) in managed_below:
                    if not _under_managing_unit(root, module_name):
                        shared_with_child.append(f"{fqn!r} (managed as {managed_below[id(param)]!r})")
                    continue
                entry = found.setdefault(id(param), (fqn, [], param))
                if (module, name) not in entry[1]:
                    entry[1].append((module, name))
    return list(found.values()), shared_with_child


def _under_other_api(root: nn.Module, module_name: str) -> bool:
    """Whether the module at ``module_name`` (below ``root``) sits in a subtree another
    composable API manages (torch's ``replicate``, which all-reduces its gradients itself):
    FSDP2 leaves such subtrees out of the unit (``_is_composable_with_fsdp``)."""
    module = root
    for part in module_name.split(".") if module_name else []:
        module = getattr(module, part)
        if not _is_composable_with_fsdp(module):
            return True
    return False


def _under_managing_unit(root: nn.Module, module_name: str) -> bool:
    """Whether the module at ``module_name`` sits inside a unit (so its params are that unit's)."""
    module = root
    for part in module_name.split(".") if module_name else []:
        module = getattr(module, part)
        if vars(module).get("_vescale_fsdp_unit") is not None:
            return True
    return False

"""torch's ``fully_shard`` inside the strategy's model hooks runs veScale-FSDP's instead.

Recipes written for Lightning's ``ModelParallelStrategy`` shard the model themselves with
torch's FSDP2 (LitGPT's LoRA ``parallelize_fn``, a Trainer ``configure_model``). So that they
run unchanged under the vescale_fsdp strategies, the strategies call them inside
:func:`torch_fully_shard_routed`: there every ``torch.distributed`` module that exports torch's
``fully_shard`` (``torch.distributed.fsdp``, the older ``torch.distributed._composable.fsdp``
paths) exports ``vescale_plugins.fully_shard``, which takes the same arguments. A name bound
before the hook runs (``from torch.distributed.fsdp import fully_shard`` at a module's top)
still reaches torch's: :func:`refuse_torch_fsdp2_units` then stops set-up with a message
that says so, before any collective of ours.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from lightning.fabric.utilities.rank_zero import rank_zero_info

from vescale_plugins import fully_shard

__all__ = ["refuse_torch_fsdp2_units", "torch_fully_shard_routed"]

_TORCH_FULLY_SHARD = torch_fsdp.fully_shard
with suppress(ImportError):  # the older path LitGPT imports from, loaded so that it is routed too
    importlib.import_module("torch.distributed._composable.fsdp.fully_shard")
# The module attributes are process-wide: they are swapped while at least one hook runs (ranks
# run as threads of one process each enter), never held across the hook, whose fully_shard
# calls are collectives among those threads. Each thread logs for the hook it runs.
_LOCK = threading.Lock()
_active = 0
_patched: list[Any] = []
_hook = threading.local()


@functools.wraps(fully_shard)
def _routed(module: Any, *args: Any, **kwargs: Any) -> Any:
    name = getattr(_hook, "name", None)
    if name is not None and not _hook.logged:
        _hook.logged = True
        rank_zero_info(
            f"veScale-FSDP: {name} called torch.distributed.fsdp.fully_shard; the vescale_fsdp strategy runs "
            "vescale_plugins.fully_shard (same arguments) in its place"
        )
    return fully_shard(module, *args, **kwargs)


@contextmanager
def torch_fully_shard_routed(hook: str) -> Iterator[None]:
    """Inside, ``torch.distributed.fsdp.fully_shard`` (every public path torch exports it
    under) is ``vescale_plugins.fully_shard``; the first routed call logs one line on rank 0."""
    global _active
    _hook.name, _hook.logged = hook, False
    with _LOCK:
        if _active == 0:
            # The public paths only: torch's fully_shard reads its own global (``fully_shard.state``)
            # in its private ``_fully_shard`` modules, which must stay torch's.
            _patched[:] = [
                m
                for name, m in list(sys.modules.items())
                if name.startswith("torch.distributed")
                and "._fully_shard" not in name
                and getattr(m, "fully_shard", None) is _TORCH_FULLY_SHARD
            ]
            for namespace in _patched:
                namespace.fully_shard = _routed
        _active += 1
    try:
        yield
    finally:
        _hook.name = None
        with _LOCK:
            _active -= 1
            if _active == 0:
                for namespace in _patched:
                    namespace.fully_shard = _TORCH_FULLY_SHARD
                _patched.clear()


def refuse_torch_fsdp2_units(module: nn.Module, when: str) -> None:
    """Raise if torch's FSDP2 already manages any module of ``module``: the two engines cannot
    share a model (torch's units hold FSDP2 DTensors our units would shard again)."""
    found = [
        name or "<root>"
        for name, m in module.named_modules()
        if isinstance(m, torch_fsdp.FSDPModule) and "_vescale_fsdp_unit" not in vars(m)
    ]
    if found:
        raise ValueError(
            f"{', '.join(found[:4])}{' ...' if len(found) > 4 else ''} of {type(module).__name__} were sharded by "
            f"torch.distributed.fsdp.fully_shard (FSDP2) {when}; the vescale_fsdp strategy cannot train a model "
            "FSDP2 manages. Build the model unsharded and let the strategy shard it, call vescale_plugins.fully_shard "
            "instead, or call torch's fully_shard inside parallelize_fn / configure_model, where the strategy runs "
            "vescale_plugins.fully_shard in its place (a name imported before, at a module's top, is not routed)"
        )

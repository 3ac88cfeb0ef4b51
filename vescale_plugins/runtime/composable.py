"""A unit as torch's other composable APIs see it: a module ``fully_shard`` manages.

torch's ``replicate`` (``torch.distributed._composable``, and the FSDP2-based
``replicate_with_fsdp``) leaves alone the modules whose composable-API registry names
``fully_shard``, their parameters included: without the entry it would take our sharded
DTensor parameters for tensor-parallel ones and swap in their local shards. FSDP2's
``@contract`` decorator writes that entry on the root modules of each call; so do we.

``@contract`` also keeps the call's state object there, which ``fully_shard.state(module)``
returns: ``torch.distributed.pipelining`` reaches FSDP2's units through it at its reduce-grad
step. We keep there the state object ``module.py`` gives pipelining, under the same key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.utils import _get_root_modules

__all__ = ["register_as_fully_shard"]


def register_as_fully_shard(modules: list[nn.Module], state_of: Callable[[nn.Module], object]) -> None:
    """Name ``fully_shard`` in the registry of the roots among ``modules``, as FSDP2 does, and
    keep ``state_of(root)`` where ``torch.distributed.fsdp.fully_shard.state(root)`` finds it."""
    # @contract keys the states by the function it decorates (functools.wraps keeps it).
    key = torch_fully_shard.__wrapped__  # type: ignore[attr-defined]
    for module in _get_root_modules(modules):
        module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())
        module.__dict__.setdefault(STATE_KEY, OrderedDict()).setdefault(key, state_of(module))

"""A unit as torch's other composable APIs see it: a module ``fully_shard`` manages.

torch's ``replicate`` (``torch.distributed._composable``, and the FSDP2-based
``replicate_with_fsdp``) leaves alone the modules whose composable-API registry names
``fully_shard``, their parameters included: without the entry it would take our sharded
DTensor parameters for tensor-parallel ones and swap in their local shards. FSDP2's
``@contract`` decorator writes that entry on the root modules of each call; so do we.
"""

from __future__ import annotations

from collections import OrderedDict

import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.utils import _get_root_modules

__all__ = ["register_as_fully_shard"]


def register_as_fully_shard(modules: list[nn.Module]) -> None:
    """Name ``fully_shard`` in the registry of the roots among ``modules``, as FSDP2 does."""
    for module in _get_root_modules(modules):
        module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())

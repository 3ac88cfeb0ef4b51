"""Healing a torchft replica group from a live one, for both our engine and FSDP2.

torchft (``pip install torchft``; not a dependency of this package) heals a restarted
replica group by sending it a live group's state dict through a checkpoint transport. Its
``PGTransport`` sends each tensor's whole ``untyped_storage()``: a shard of one of our units is
a view into the unit's flat buffer, so it would send that buffer once per parameter (and
FSDP2's shards, their padding). :class:`PGTransport` here is torchft's, over tensors that own
exactly their bytes (:func:`own_storages`: the same memory, no copy), so a heal sends each
shard's elements once. Use it wherever torchft's is constructed::

    from vescale_plugins.checkpoint.fault_tolerance import PGTransport

    transport = PGTransport(pg, timeout=timedelta(seconds=60), device=device)
    manager = torchft.Manager(pg=pg, checkpoint_transport=transport, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
from torch.utils._pytree import tree_map
from torchft.checkpointing.pg_transport import PGTransport as _TorchftPGTransport
from torchft.process_group import ProcessGroup

from vescale_plugins.ragged.dtensor import with_own_bytes

__all__ = ["PGTransport", "own_storages"]

T = TypeVar("T")


def own_storages(state_dict: T) -> T:
    """``state_dict`` with every tensor (and DTensor's local tensor) over a storage of exactly
    its bytes: views of the same memory, no copy. For a serialisation, not to keep."""
    return tree_map(with_own_bytes, state_dict)


class PGTransport(_TorchftPGTransport[T]):
    """torchft's ``PGTransport`` sending (and receiving in place into) tensors that own exactly
    their bytes: a heal sends each shard once, not its unit's whole buffer per parameter."""

    def __init__(
        self,
        pg: ProcessGroup | torch.distributed.ProcessGroup,
        timeout: timedelta,
        device: torch.device,
        state_dict: Callable[[], object] | None = None,
    ) -> None:
        def own_state_dict() -> object:
            assert state_dict is not None
            return own_storages(state_dict())

        super().__init__(pg, timeout, device, own_state_dict if state_dict is not None else None)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        super().send_checkpoint(dst_ranks, step, own_storages(state_dict), timeout)

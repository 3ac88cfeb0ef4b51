"""Released CPU storages kept for the next gather, so steady-state steps do not page-fault.

Unsharded buffers release their memory after use and take it again before the next use.
With the plain ``resize_(0)`` / ``resize_(n)``, glibc hands blocks this large straight back
to the kernel (``munmap``) and maps them afresh, and every first touch of a new page is a
minor page fault: 6-10K per step on the CPU benchmark. A pool keeps a released storage's
memory and moves it into the next buffer of the same kind and size that is allocated (one
unit's gather reuses what another unit released): ``UntypedStorage._swap_data_ptr_`` moves
the memory between storages, so the buffer keeps its storage object and every view cut from
it stays valid.

The pool belongs to one root unit (its model); it dies with it. It holds at most
``MAX_PER_KEY`` storages of each (kind, bytes, device) key and is emptied at the end of the
root's forward and of backward, so the memory it holds is only what the next gathers of the
same pass take again: the loss, the start of backward and the optimizer step see none of it.

CUDA's caching allocator already keeps freed blocks; the pool is CPU only.
"""

from __future__ import annotations

import os

import torch

__all__ = ["StoragePool", "MAX_PER_KEY", "ENABLED"]

# Off by default: measured on the default CPU bench (W=2), the pool cut veScale's minor page
# faults per step from ~3.5K to ~0.7K but raised its peak tensor memory by 12 % (the root's
# buffers held through the optimizer step). Emptying it at the end of backward as well is
# meant to remove that; not yet measured, so the runtime uses the pool only when this is set
# (or the environment has VESCALE_FSDP_STORAGE_POOL=1, which reaches spawned ranks too).
ENABLED = os.environ.get("VESCALE_FSDP_STORAGE_POOL", "0") == "1"

# A unit's storage waits in the pool from its release until the gather after the next one
# (one unit prefetched ahead); two per key also covers the last units released in backward.
MAX_PER_KEY = 2

PoolKey = tuple[str, int, torch.device]


class StoragePool:
    """Storages of released buffers, by (kind, nbytes, device); CPU only.

    Attributes:
        held_bytes: bytes the pool holds now (memory allocated but in no buffer).
        reused: allocations served from the pool since creation (a count, for tests).
    """

    def __init__(self) -> None:
        self._free: dict[PoolKey, list[torch.UntypedStorage]] = {}
        self.held_bytes = 0
        self.reused = 0

    @staticmethod
    def accepts(device: torch.device) -> bool:
        return ENABLED and device.type == "cpu"

    def put(self, kind: str, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory into the pool (``storage`` is left empty), or free it
        when the pool already holds ``MAX_PER_KEY`` of its key."""
        nbytes = storage.nbytes()
        key = (kind, nbytes, storage.device)
        kept = self._free.setdefault(key, [])
        if len(kept) >= MAX_PER_KEY or not self.accepts(storage.device):
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        storage._swap_data_ptr_(holder)
        kept.append(holder)
        self.held_bytes += nbytes

    def take(self, kind: str, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` a pooled block of ``nbytes`` of this kind; False if none."""
        kept = self._free.get((kind, nbytes, storage.device))
        if not kept:
            return False
        storage._swap_data_ptr_(kept.pop())
        self.held_bytes -= nbytes
        self.reused += 1
        return True

    def clear(self) -> None:
        """Free every pooled block."""
        self._free.clear()
        self.held_bytes = 0

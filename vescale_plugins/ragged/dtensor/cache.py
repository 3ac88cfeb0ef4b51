"""What the DTensor integration works out once per layout and keeps: one cache per mesh.

torch's own Python sharding cache answers ``_foreach_*`` ops on releases whose C++ cache builds
them no key (before 2.13); the ragged rules, the checks of a ragged spec and the specs of
norms are ours to keep (:mod:`.propagation`, :mod:`.norms`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardingCache"]

T = TypeVar("T")


class ShardingCache:
    """Answers worked out for one mesh, per thread (as torch's own Python cache is), the least
    recently used dropped past ``capacity``.

    Kept on the mesh itself rather than in a module-level table, so that nothing global holds
    a mesh (and, through it, its process groups) alive: the mesh, its cache and the specs in
    it are one cycle the collector frees together. A copied or pickled mesh starts with an
    empty cache."""

    capacity = 4096
    ATTRIBUTE = "_vescale_plugins_sharding_cache"

    def __init__(self) -> None:
        self._local = threading.local()

    def _entries(self) -> OrderedDict[Hashable, Any]:
        entries = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = OrderedDict()
        return entries

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The answer for ``key``, from ``compute()`` the first time (nothing is kept when it
        raises: a refused layout is refused again)."""
        entries = self._entries()
        try:
            entries.move_to_end(key)
            return entries[key]
        except KeyError:
            value = entries[key] = compute()
            if len(entries) > self.capacity:
                entries.popitem(last=False)
            return value

    def __len__(self) -> int:
        return len(self._entries())

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (ShardingCache, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardingCache:
        return ShardingCache()

    @classmethod
    def of(cls, mesh: DeviceMesh) -> ShardingCache:
        cache = mesh.__dict__.get(cls.ATTRIBUTE)
        if cache is None:
            cache = mesh.__dict__[cls.ATTRIBUTE] = cls()
        return cache

"""One cross-rank agreement: every rank computes something, and all raise the same error if
any rank failed or computed something else.

A distributed set-up that fails on one rank only hangs (or aborts) the others at their first
collective, far from the cause. ``fully_shard``'s plan (:mod:`.setup`) and the all-gather
extensions' inputs (:mod:`.extensions`) are agreed on with :func:`agree_across_ranks`: one
all-reduce of a fixed-size vector whatever the world size (the first rank that failed, and a
fingerprint of each rank's result); more is exchanged only on a failure (the failing rank's
error) or a mismatch (every rank's description, to name the first difference).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["agree_across_ranks"]

T = TypeVar("T")

_DIGEST_WORDS = 4  # 56-bit words of the fingerprint (exact in int64, signs never overflow)


def agree_across_ranks(
    compute: Callable[[], T],
    describe: Callable[[T], Sequence[Any]],
    group: dist.ProcessGroup | None,
    *,
    catch: tuple[type[Exception], ...],
    explain: Callable[[Exception], Any],
    remote_failure: Callable[[int, Any], Exception],
    mismatch: Callable[[list[Any], int], Exception],
) -> T:
    """``compute()`` on every rank of ``group``, then one fixed-size exchange.

    ``describe(result)`` lists what must be the same on every rank (its ``repr`` is
    fingerprinted). An error of a ``catch`` class raised by ``compute`` is raised again on
    its rank; every other rank raises ``remote_failure(rank, explain(error))`` for the first
    rank that failed (``explain``'s value travels pickled: the exception itself may not
    pickle). If the descriptions differ, every rank raises ``mismatch(descriptions, rank)``
    with every rank's description and its own rank in ``group``. Without a group (or with
    one rank) nothing is exchanged.
    """
    error: Exception | None = None
    entries: list[Any] = []
    try:
        result = compute()
        entries = list(describe(result))
    except catch as raised:
        error = raised
    # From here on, result is set unless error is (which is raised first).
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return result
    fingerprint = hashlib.sha256(repr(entries).encode()).digest() if error is None else b""
    first_failed, agreed = _exchange_outcome(group, error is not None, fingerprint)
    size = dist.get_world_size(group)
    if first_failed < size:
        message: list[Any] = [explain(error) if error is not None else None]
        dist.broadcast_object_list(message, group=group, group_src=first_failed)
        if error is not None:
            raise error
        raise remote_failure(first_failed, message[0])
    if agreed:
        return result
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, entries, group=group)
    raise mismatch(everyone, dist.get_rank(group))


def _exchange_outcome(group: dist.ProcessGroup, failed: bool, fingerprint: bytes) -> tuple[int, bool]:
    """One all-reduce of a fixed-size vector (whatever the world size): the first rank of
    ``group`` that failed (or the group's size) and whether every rank's fingerprint is the
    same. MAX over ``(-first failed, words, -words)`` gives the least failing rank, and each
    word's maximum and minimum."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    words = [int.from_bytes(fingerprint[7 * i : 7 * i + 7], "big") for i in range(_DIGEST_WORDS)]
    device = torch.device(dist.distributed_c10d._get_object_coll_device(group))
    vector = torch.tensor([-(rank if failed else size), *words, *(-w for w in words)], dtype=torch.int64, device=device)
    dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=group)
    values = vector.tolist()
    highest, lowest = values[1 : 1 + _DIGEST_WORDS], [-v for v in values[1 + _DIGEST_WORDS :]]
    return -values[0], highest == lowest

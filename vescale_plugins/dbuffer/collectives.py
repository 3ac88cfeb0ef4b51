"""All-gather and reduce-scatter that write into the caller's buffers, on every backend.

DBuffer's collectives are meant to run in place: the all-gather writes the unsharded buffer
whose slices are the parameters, the reduce-scatter reads the unsharded gradient buffer and
writes the sharded one. NCCL's tensor collectives do exactly that. gloo's do not: its
``all_gather_into_tensor`` gathers into a new flat tensor of the output's size and copies it
out, and its ``reduce_scatter_tensor`` clones the whole input, all-reduces the clone (twice
the traffic of a reduce-scatter) and copies this rank's chunk out. Each is a full-buffer
temporary beside the buffers DBuffer already holds.

On gloo the same two collectives are built here from point-to-point messages between views
of the caller's buffers: every message lands where it belongs, and the traffic per rank is a
ring's, ``(W - 1) / W`` of the buffer. Measured on a 2-core CPU with 4 MiB shards
(``python -m vescale_plugins.bench collectives --world-size W``), gloo's all-gather /
reduce-scatter against these: W=2 7.8 / 9.9 ms against 4.7 / 5.4 ms; W=3 12.2 / 21.2 against
9.9 / 10.1 ms; and temporaries of a full buffer each against none (reduce-scatter at W > 2:
``W - 2`` shards).

Messages between one pair of ranks with one tag are matched in the order they were posted,
and every rank posts its collectives in the same order, so collectives in flight at the same
time (a prefetched all-gather beside a reduce-scatter) cannot take each other's messages.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.profiler import record_function

from vescale_plugins.ragged.collectives import _all_gather_single, _reduce_scatter_single

__all__ = ["all_gather_into", "reduce_scatter_into", "uses_point_to_point", "POINT_TO_POINT_SCOPE"]

# Profiler scope of these collectives: what runs inside is the collective's own work (its
# local write and sums), as what gloo or NCCL do inside theirs.
POINT_TO_POINT_SCOPE = "vescale_p2p::"

T = TypeVar("T")

# Tags of the point-to-point messages, one per collective kind.
_ALL_GATHER_TAG = 0x5647
_REDUCE_SCATTER_TAG = 0x5653


def uses_point_to_point(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether this group's tensor collectives on ``device`` stage full copies (gloo on CPU)."""
    return device.type == "cpu" and _cpu_backend_is_gloo(group)


def _per_group(compute: Callable[[dist.ProcessGroup], T]) -> Callable[[dist.ProcessGroup], T]:
    """Cache ``compute(group)`` once per group, holding the group weakly.

    A strong cache (``functools.lru_cache``) kept every group, its gloo worker threads and
    its transport alive after ``destroy_process_group``, until interpreter teardown destroyed
    them in no particular order (an exit-time abort, ``terminate called without an active
    exception``, in some runs).
    """
    cache: weakref.WeakKeyDictionary[dist.ProcessGroup, T] = weakref.WeakKeyDictionary()

    @functools.wraps(compute)
    def cached(group: dist.ProcessGroup) -> T:
        try:
            return cache[group]
        except KeyError:
            value = cache[group] = compute(group)
            return value

    return cached


@_per_group
def _cpu_backend_is_gloo(group: dist.ProcessGroup) -> bool:
    # Looked up once per group: every collective of every unit asks.
    if dist.get_world_size(group) == 1:
        return False
    backend = dist.get_backend(group)  # "gloo", or per device: "cpu:gloo,cuda:nccl"
    by_device = dict(part.split(":", 1) for part in backend.split(",")) if ":" in backend else {"cpu": backend}
    return by_device.get("cpu") == "gloo"


class PointToPointWork:
    """The sends and receives of one collective; ``wait()`` completes them, then ``finish``."""

    def __init__(
        self, works: list[dist.Work], finish: Callable[[], None] | None = None, keep_alive: tuple = ()
    ) -> None:
        self._works, self._finish = works, finish
        self._keep_alive = keep_alive  # tensors a pending send still reads

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works, self._keep_alive = [], ()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def _posted(work: dist.Work | None) -> dist.Work:
    # isend/irecv return None only on a rank outside the group; these run on its members.
    assert work is not None
    return work


@_per_group
def _peers(group: dist.ProcessGroup) -> tuple[int, tuple[tuple[int, int], ...]]:
    """This rank's index in the group and ``(group index, global rank)`` of every other rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank, tuple((r, dist.get_global_rank(group, r)) for r in range(world) if r != rank)


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | PointToPointWork | None:
    """``output[r * n:(r + 1) * n]`` = rank r's ``shard`` on every rank (``n = shard.numel()``)."""
    if not uses_point_to_point(group, output.device):
        return _all_gather_single(output, shard, group=group, async_op=async_op)
    with record_function(POINT_TO_POINT_SCOPE + "all_gather"):
        rank, peers = _peers(group)
        n = shard.numel()
        chunks = output.view(-1).split(n)
        works = [_posted(dist.isend(shard, dst, group=group, tag=_ALL_GATHER_TAG)) for _, dst in peers]
        works += [_posted(dist.irecv(chunks[r], src, group=group, tag=_ALL_GATHER_TAG)) for r, src in peers]
        # This rank's own chunk: the one local write of any all-gather (NCCL makes it too).
        chunks[rank].copy_(shard.view(-1))
    work = PointToPointWork(works, keep_alive=(shard,))
    if not async_op:
        work.wait()
        return None
    return work


def reduce_scatter_into(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | PointToPointWork | None:
    """``output`` = the sum over ranks of their ``full[rank * n:(rank + 1) * n]`` (``n = output.numel()``).

    The first peer's chunk is received straight into ``output``; the others (W > 2) into one
    staging buffer of ``W - 2`` chunks. ``output`` must not overlap ``full``.
    """
    if not uses_point_to_point(group, output.device):
        return _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    with record_function(POINT_TO_POINT_SCOPE + "reduce_scatter"):
        rank, peers = _peers(group)
        n = output.numel()
        chunks = full.view(-1).split(n)
        out = output.view(-1)
        staging = out.new_empty((len(peers) - 1, n))
        targets = [out, *staging.unbind(0)]
        works = [_posted(dist.isend(chunks[r], dst, group=group, tag=_REDUCE_SCATTER_TAG)) for r, dst in peers]
        works += [
            _posted(dist.irecv(target, src, group=group, tag=_REDUCE_SCATTER_TAG))
            for target, (_, src) in zip(targets, peers)
        ]

    def add_the_rest() -> None:
        with record_function(POINT_TO_POINT_SCOPE + "reduce_scatter_sum"):
            out.add_(chunks[rank])
            for received in targets[1:]:
                out.add_(received)

    work = PointToPointWork(works, add_the_rest, keep_alive=(full,))
    if not async_op:
        work.wait()
        return None
    return work

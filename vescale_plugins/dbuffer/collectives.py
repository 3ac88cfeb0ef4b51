"""All-gather and reduce-scatter that write into the caller's buffers, on every backend.

DBuffer's collectives are meant to run in place: the all-gather writes the unsharded buffer
whose slices are the parameters, the reduce-scatter reads the unsharded gradient buffer and
writes the sharded one. NCCL's tensor collectives do exactly that. gloo's do not: its
``all_gather_into_tensor`` gathers into a new flat tensor of the output's size and copies it
out, and its ``reduce_scatter_tensor`` clones the whole input, all-reduces the clone (twice
the traffic of a reduce-scatter) and copies this rank's chunk out. Each is a full-buffer
temporary beside the buffers DBuffer already holds.

On gloo the same two collectives are built here from point-to-point messages between views
of the caller's buffers: every message lands where it belongs, the traffic per rank is a
ring's, ``(W - 1) / W`` of the buffer, and no full-buffer temporary is made (the
reduce-scatter at W > 2 stages ``W - 2`` shards). Timings: ``docs/collectives.md``.

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

from vescale_plugins.dbuffer import observer
from vescale_plugins.planner.bounds import round_up
from vescale_plugins.ragged.ragged_collectives import all_gather_single, reduce_scatter_single

__all__ = ["all_gather_into", "gloo_sum_orders", "reduce_scatter_into", "uses_point_to_point", "POINT_TO_POINT_SCOPE"]

# Profiler scope of these collectives, while a profiler runs (observer.region): what runs
# inside is the collective's own work (its local write and sums), as what gloo or NCCL do
# inside theirs.
POINT_TO_POINT_SCOPE = "vescale_p2p::"

T = TypeVar("T")

# Tags of the point-to-point messages, one per collective kind.
_ALL_GATHER_TAG = 0x5647
_REDUCE_SCATTER_TAG = 0x5653


def uses_point_to_point(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether this group's tensor collectives on ``device`` stage full copies (gloo on CPU)."""
    return device.type == "cpu" and _cpu_backend_is_gloo(group)


def _per_group(compute: Callable[[dist.ProcessGroup], T]) -> Callable[[dist.ProcessGroup], T]:
    """Cache ``compute(group)`` once per group, holding the group weakly: a destroyed group
    and its gloo threads must not outlive ``destroy_process_group`` (why:
    ``docs/collectives.md``). Per group object, so ranks run as threads keep theirs apart."""
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
        works, self._works = self._works, []
        try:
            for work in works:
                work.wait()
        except BaseException:
            # A failed collective (a peer died): its messages and their tensors are dropped,
            # and its result is never finished.
            self._finish, self._keep_alive = None, ()
            del works, work  # the backend's work objects go now, not with the traceback
            raise
        self._keep_alive = ()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


@_per_group
def _peers(group: dist.ProcessGroup) -> tuple[int, tuple[tuple[int, int], ...]]:
    """This rank's index in the group and ``(group index, global rank)`` of every other rank.

    Worked out once per group, so that each message goes straight to the group's own
    ``send``/``recv`` by group index (what ``dist.isend``/``irecv`` call after checking, per
    message, that this rank is in the group and translating the global rank: some twenty
    Python calls a message, a few hundred a step)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank, tuple((r, dist.get_global_rank(group, r)) for r in range(world) if r != rank)


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | PointToPointWork | None:
    """``output[r * n:(r + 1) * n]`` = rank r's ``shard`` on every rank (``n = shard.numel()``).

    On one rank no collective runs (as FSDP2 issues none there): ``output`` is a copy of
    ``shard``."""
    if group.size() == 1:
        output.view(-1).copy_(shard.view(-1))
        return None
    if not uses_point_to_point(group, output.device):
        return all_gather_single(output, shard, group=group, async_op=async_op)
    with observer.region(POINT_TO_POINT_SCOPE + "all_gather"):
        rank, peers = _peers(group)
        n = shard.numel()
        chunks = output.view(-1).split(n)
        works = [group.send([shard], r, _ALL_GATHER_TAG) for r, _ in peers]
        works += [group.recv([chunks[r]], r, _ALL_GATHER_TAG) for r, _ in peers]
        # This rank's own chunk: the one local write of any all-gather (NCCL makes it too).
        chunks[rank].copy_(shard.view(-1))
    work = PointToPointWork(works, keep_alive=(shard,))
    if not async_op:
        work.wait()
        return None
    return work


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    average: bool = False,
    premul_divide: float | None = None,
    async_op: bool = False,
) -> dist.Work | PointToPointWork | None:
    """``output`` = the sum over ranks of their ``full[rank * n:(rank + 1) * n]`` (``n = output.numel()``).

    ``average``: the mean instead (the backend's ``AVG``: NCCL multiplies each input by
    ``1/W``, gloo divides the sum). ``premul_divide``: each input multiplied by its inverse
    first (NCCL's ``PREMUL_SUM``; here also on gloo, which has none; ``full`` is scaled in
    place). On one rank no collective runs: ``output`` is ``full``, divided by
    ``premul_divide`` if given (FSDP2's arithmetic there).

    On gloo the sum is taken in the order gloo's own ``reduce_scatter_tensor`` takes it (see
    :func:`gloo_sum_orders`): the same bits as that collective on the same buffer. The
    peer that comes first in that order sends straight into ``output``; the others (W > 2)
    into one staging buffer of ``W - 2`` chunks. ``output`` must not overlap ``full``.
    """
    if dist.get_world_size(group) == 1:
        output.copy_(full if premul_divide is None else full / premul_divide)
        return None
    if not uses_point_to_point(group, output.device):
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
        if average:
            op = dist.ReduceOp.AVG
        elif premul_divide is not None:
            op = dist.ReduceOp.PREMUL_SUM(1 / premul_divide)  # FSDP2's spelling (NCCL's PreMulSum)
        return reduce_scatter_single(output, full, op=op, group=group, async_op=async_op)
    if premul_divide is not None:
        full.mul_(1 / premul_divide)
    with observer.region(POINT_TO_POINT_SCOPE + "reduce_scatter"):
        rank, peers = _peers(group)
        world = len(peers) + 1
        n = output.numel()
        chunks = full.view(-1).split(n)
        out = output.view(-1)
        staging = out.new_empty((world - 2, n))
        by_rank: dict[int, torch.Tensor] = {rank: chunks[rank], (rank - 1) % world: out}
        by_rank.update(zip([(rank - k) % world for k in range(2, world)], staging.unbind(0)))
        works = [group.send([chunks[r]], r, _REDUCE_SCATTER_TAG) for r, _ in peers]
        works += [group.recv([by_rank[r]], r, _REDUCE_SCATTER_TAG) for r, _ in peers]

    def sum_in_gloos_order() -> None:
        with observer.region(POINT_TO_POINT_SCOPE + "reduce_scatter_sum"):
            regions = gloo_sum_orders(world, rank, n, out.element_size())
            # Elements whose sum gloo ends on another rank (a few, where its segments do not
            # fall on our chunk's bounds) first, from the values before ``out`` is summed into.
            others = []
            for start, stop, order in regions:
                if order[-1] != rank:
                    total = by_rank[order[0]][start:stop].clone()
                    for r in order[1:]:
                        total.add_(by_rank[r][start:stop])
                    others.append((start, stop, total))
            for r in [(rank - k) % world for k in range(2, world + 1)]:
                out.add_(by_rank[r])
            for start, stop, total in others:
                out[start:stop].copy_(total)
            if average:
                out.div_(world)  # gloo's AVG: the sum, divided

    work = PointToPointWork(works, sum_in_gloos_order, keep_alive=(full,))
    if not async_op:
        work.wait()
        return None
    return work


# gloo's ring all-reduce cuts its input into segments of at most 1 MiB (``kMaxSegmentSize``).
_GLOO_MAX_SEGMENT_BYTES = 1 << 20


@functools.cache  # per buffer shape: asked at every reduce-scatter
def gloo_sum_orders(world: int, rank: int, n: int, element_size: int) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """In which order of ranks gloo's ``reduce_scatter_tensor`` of ``world * n`` elements sums
    the elements of ``rank``'s chunk: ``(start, stop, ranks)`` over the chunk, in elements.

    gloo reduce-scatters by all-reducing the whole input with its ring algorithm
    (``gloo/allreduce.cc``, ``ring``): the input is cut into ``S`` segments (a multiple of
    ``world``, at least ``2 * world``, each at most 1 MiB), the ``S / world`` consecutive
    segments of chunk ``k`` are summed along the ring from rank ``k - 1`` down to rank ``k``:
    ``((x[k-1] + x[k-2]) + ...) + x[k]``. Segments are rounded to whole elements, so chunk
    ``k`` of gloo's may start a few elements off ``k * n``.
    """
    total = world * n * element_size
    max_segment = element_size * max(1, _GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = round_up(max(-(-total // max_segment), 2 * world), world)
    segment_bytes = round_up(-(-total // segments), element_size)
    chunk_elements = segments // world * segment_bytes // element_size  # gloo's chunk, in elements
    regions = []
    first, last = rank * n, (rank + 1) * n
    for k in range(first // chunk_elements, min(world, -(-last // chunk_elements))):
        start, stop = max(first, k * chunk_elements), min(last, (k + 1) * chunk_elements)
        if start < stop:
            regions.append((start - first, stop - first, tuple((k - j) % world for j in range(1, world + 1))))
    return tuple(regions)

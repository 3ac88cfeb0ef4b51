"""Moving Muon's matrices between their shards and their root ranks, two all-to-alls a bucket.

Every rank's shard of a RaggedShard matrix is one contiguous interval of its row-major
storage, and the intervals are in rank order (``ragged_layout``), so the matrix is the
concatenation of the ranks' pieces. A *bucket* holds at most one matrix per root: the first
``all_to_all_single`` sends each rank's piece of each matrix of the bucket to that matrix's
root, and the root's receive buffer *is* its full matrix (the pieces arrive in rank order,
no reassembly); after Newton–Schulz the root's output is already laid out as the ranks'
intervals, so the second ``all_to_all_single`` sends each rank its interval of the update
with no packing either. Both carry bfloat16: Newton–Schulz rounds its input to bfloat16
first, and its output is bfloat16, so this is exact and half of fp32's bytes.

gloo (CPU) implements ``all_to_all_single`` with uneven splits and ``async_op``, so both
backends use the one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vescale_plugins.optim.root_assignment import assign_roots, newton_schulz_flops

__all__ = ["MatrixSlot", "ExchangePlan", "build_exchange_plan", "BucketExchange"]

# What the two all-to-alls carry (Newton–Schulz works in bfloat16 either way).
EXCHANGE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class MatrixSlot:
    """One sharded matrix: its global ``shape``, its ``root`` rank, and every rank's
    ``(offset, length)`` interval of its flat storage, in elements."""

    shape: tuple[int, int]
    root: int
    spans: tuple[tuple[int, int], ...]

    def length_on(self, rank: int) -> int:
        """Elements of this matrix held by ``rank``."""
        return self.spans[rank][1]


@dataclass(frozen=True)
class ExchangePlan:
    """The root of every matrix and the buckets they travel in, the same on every rank.

    ``buckets`` holds matrix indices; a bucket has at most one matrix per root, sorted by
    root, and bucket ``k`` holds the ``k``-th largest matrix of each root (so every bucket's
    Newton–Schulz work is spread over the ranks).
    """

    world_size: int
    matrices: tuple[MatrixSlot, ...]
    buckets: tuple[tuple[int, ...], ...]
    ns_flops_per_rank: tuple[int, ...]

    def bytes_sent(self, rank: int) -> int:
        """Bytes ``rank`` sends to other ranks in one step (both all-to-alls, bfloat16)."""
        itemsize = torch.finfo(EXCHANGE_DTYPE).bits // 8
        elements = 0
        for m in self.matrices:
            if m.root == rank:
                elements += sum(length for r, (_, length) in enumerate(m.spans) if r != rank)
            else:
                elements += m.length_on(rank)
        return elements * itemsize


def build_exchange_plan(
    shapes: Sequence[tuple[int, int]],
    spans: Sequence[Sequence[tuple[int, int]]],
    world_size: int,
    ns_steps: Sequence[int],
) -> ExchangePlan:
    """Assign roots by Newton–Schulz cost (longest first, least loaded rank) and form buckets."""
    costs = [newton_schulz_flops(shape, steps) for shape, steps in zip(shapes, ns_steps)]
    assignment = assign_roots(costs, world_size)
    matrices = tuple(
        MatrixSlot((rows, cols), root, tuple((offset, length) for offset, length in span))
        for (rows, cols), root, span in zip(shapes, assignment.roots, spans)
    )
    per_root = [assignment.matrices_of(rank) for rank in range(world_size)]
    depth = max((len(ids) for ids in per_root), default=0)
    buckets = tuple(tuple(ids[k] for ids in per_root if k < len(ids)) for k in range(depth))
    return ExchangePlan(world_size, matrices, buckets, assignment.loads)


class BucketExchange:
    """The two all-to-alls of one bucket on this rank, issued asynchronously."""

    def __init__(self, plan: ExchangePlan, bucket: Sequence[int], rank: int, group: dist.ProcessGroup) -> None:
        self.plan, self.bucket, self.rank, self.group = plan, tuple(bucket), rank, group
        by_root = {plan.matrices[i].root: i for i in self.bucket}
        world = plan.world_size
        # The matrix this rank orthogonalises in this bucket, if any.
        self.own = by_root.get(rank)
        # First all-to-all: to each root, my piece of its matrix; from each rank, its piece of mine.
        self.to_root_splits = [plan.matrices[by_root[r]].length_on(rank) if r in by_root else 0 for r in range(world)]
        own = plan.matrices[self.own] if self.own is not None else None
        self.from_owner_splits = [own.length_on(r) for r in range(world)] if own else [0] * world
        self._gathered: torch.Tensor | None = None
        self._returned: torch.Tensor | None = None

    def scatter_to_roots(self, pieces: dict[int, torch.Tensor], device: torch.device) -> dist.Work | None:
        """Send this rank's flat bfloat16 ``pieces`` (by matrix index) to their roots."""
        ordered = [pieces[i] for i in sorted(self.bucket, key=lambda i: self.plan.matrices[i].root)]
        send = torch.cat(ordered) if ordered else torch.empty(0, dtype=EXCHANGE_DTYPE, device=device)
        self._gathered = send.new_empty(sum(self.from_owner_splits))
        return dist.all_to_all_single(
            self._gathered, send, self.from_owner_splits, self.to_root_splits, group=self.group, async_op=True
        )

    def gathered_matrix(self) -> torch.Tensor | None:
        """This rank's full matrix of the bucket (after the first all-to-all), or None."""
        if self.own is None:
            return None
        assert self._gathered is not None  # scatter_to_roots ran
        return self._gathered.view(self.plan.matrices[self.own].shape)

    def return_to_owners(self, update: torch.Tensor | None, device: torch.device) -> dist.Work | None:
        """Send each rank its interval of this rank's orthogonalised matrix (``update``)."""
        send = (
            update.contiguous().view(-1) if update is not None else torch.empty(0, dtype=EXCHANGE_DTYPE, device=device)
        )
        self._gathered = None
        self._returned = send.new_empty(sum(self.to_root_splits))
        return dist.all_to_all_single(
            self._returned, send, self.to_root_splits, self.from_owner_splits, group=self.group, async_op=True
        )

    def returned_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """``(matrix index, this rank's interval of its update)`` for the bucket's matrices."""
        ordered = sorted(self.bucket, key=lambda i: self.plan.matrices[i].root)
        sizes = [self.plan.matrices[i].length_on(self.rank) for i in ordered]
        assert self._returned is not None  # return_to_owners ran
        return list(zip(ordered, self._returned.split(sizes)))

"""The collectives that move ragged shards, over one process group (one mesh dim).

Public ``torch.distributed`` API only. Every function takes the local tensor of this rank,
the layouts involved and the group, and returns a new local tensor. Lengths are elements.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vescale_plugins.ragged.layout import RaggedLayout

__all__ = [
    "all_gather_single",
    "reduce_scatter_single",
    "gather_ragged",
    "reshard_ragged",
    "reduce_scatter_ragged",
    "ragged_to_partial_sum",
    "gather_shard_dim",
    "split_shard_dim",
]


# The tensor-in/tensor-out collectives under their torch 2.13 names; the same functions,
# same arguments, under their older names before.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _lengths(layout: RaggedLayout) -> list[int]:
    return [s.length for s in layout.slices]


def gather_ragged(local: torch.Tensor, layout: RaggedLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """Variable-size all-gather: every rank's ragged shard -> the full tensor on every rank.

    Equal shards gather straight into the output. A single holder broadcasts. Otherwise each
    shard is padded to the longest one (gloo and NCCL both need equal all-gather inputs), and
    the result is compacted with one copy.
    """
    lengths = _lengths(layout)
    flat = local.reshape(-1)
    holders = [r for r, n in enumerate(lengths) if n]
    if len(holders) == 1:
        full = flat.clone() if dist.get_rank(group) == holders[0] else flat.new_empty(lengths[holders[0]])
        dist.broadcast(full, group_src=holders[0], group=group)
        return full.view(layout.shape)
    longest = max(lengths)
    if all(n == longest for n in lengths):
        gathered = flat.new_empty(longest * len(lengths))
        all_gather_single(gathered, flat.contiguous(), group=group)
        return gathered.view(layout.shape)
    padded = flat.new_zeros(longest)
    padded[: flat.numel()] = flat
    gathered = flat.new_empty(longest * len(lengths))
    all_gather_single(gathered, padded, group=group)
    pieces = [gathered[r * longest : r * longest + n] for r, n in enumerate(lengths)]
    return torch.cat(pieces).view(layout.shape)


def _overlap(a_start: int, a_len: int, b_start: int, b_len: int) -> int:
    return max(0, min(a_start + a_len, b_start + b_len) - max(a_start, b_start))


def reshard_ragged(local: torch.Tensor, src: RaggedLayout, dst: RaggedLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """Ragged -> ragged: one all-to-all of the overlapping intervals.

    Both layouts cut the same flat storage into rank-ordered contiguous runs, so this rank's
    source run splits into destination ranks in order, and its destination run is the
    concatenation of what the source ranks send, in order: no packing copies.
    """
    rank = dist.get_rank(group)
    mine_src, mine_dst = src.slices[rank], dst.slices[rank]
    send = [_overlap(mine_src.offset, mine_src.length, d.offset, d.length) for d in dst.slices]
    recv = [_overlap(s.offset, s.length, mine_dst.offset, mine_dst.length) for s in src.slices]
    out = local.new_empty(mine_dst.length)
    dist.all_to_all_single(out, local.reshape(-1).contiguous(), recv, send, group=group)
    return out.view(mine_dst.local_shape)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_scatter_ragged(
    partial_full: torch.Tensor, layout: RaggedLayout, group: dist.ProcessGroup, reduce_op: str
) -> torch.Tensor:
    """Partial -> ragged: a real reduce-scatter (each rank receives only its own run).

    ``reduce_op`` is ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``; ``"avg"`` is a sum divided
    by the group size because gloo has no AVG. Uneven runs are padded to the longest (one
    copy into the send buffer); even runs reduce straight out of the input.
    """
    if reduce_op not in _REDUCE_OPS:
        raise NotImplementedError(f"reduce-scatter of Partial({reduce_op!r}) into RaggedShard is not supported")
    lengths = _lengths(layout)
    world = len(lengths)
    rank = dist.get_rank(group)
    flat = partial_full.reshape(-1).contiguous()
    longest = max(lengths)
    if all(n == longest for n in lengths):
        send = flat
    else:
        send = flat.new_zeros(longest * world)
        for r, rank_slice in enumerate(layout.slices):
            send[r * longest : r * longest + rank_slice.length] = flat[
                rank_slice.offset : rank_slice.offset + rank_slice.length
            ]
    out = flat.new_empty(longest)
    reduce_scatter_single(out, send, op=_REDUCE_OPS[reduce_op], group=group)
    if reduce_op == "avg":
        out.div_(world)
    return out[: lengths[rank]].view(layout.slices[rank].local_shape)


def ragged_to_partial_sum(local: torch.Tensor, layout: RaggedLayout, rank: int, scale: float = 1.0) -> torch.Tensor:
    """Ragged -> Partial(sum) without communication: own run in place, zeros elsewhere."""
    full = local.new_zeros(math.prod(layout.shape))
    rank_slice = layout.slices[rank]
    full[rank_slice.offset : rank_slice.offset + rank_slice.length] = local.reshape(-1) * scale
    return full.view(layout.shape)


def _chunk_sizes(dim_size: int, world: int) -> list[int]:
    """``torch.chunk`` sizes along a dim, padded with empty chunks to ``world`` entries (Shard(d))."""
    chunk = -(-dim_size // world) if dim_size else 0
    sizes = [max(0, min(chunk, dim_size - r * chunk)) for r in range(world)]
    return sizes


def split_shard_dim(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """``Shard(dim)``'s local tensor from a full one, as torch.chunk does (a contiguous copy)."""
    sizes = _chunk_sizes(full.shape[dim], world)
    start = sum(sizes[:rank])
    return full.narrow(dim, start, sizes[rank]).contiguous()


def gather_shard_dim(local: torch.Tensor, full_shape: torch.Size, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``Shard(dim)`` -> full tensor: all-gather of chunks padded to the largest, then trimmed."""
    world = dist.get_world_size(group)
    sizes = _chunk_sizes(full_shape[dim], world)
    longest = max(sizes)
    moved = local.movedim(dim, 0)
    padded = moved.new_zeros((longest, *moved.shape[1:]))
    padded[: moved.shape[0]] = moved
    gathered = padded.new_empty((longest * world, *moved.shape[1:]))
    all_gather_single(gathered, padded.contiguous(), group=group)
    pieces = [gathered[r * longest : r * longest + n] for r, n in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim).contiguous()

"""Random in-place initialisers on ragged shards: each rank draws its slice of what a draw of
the full tensor would give, so sharded ``reset_parameters()`` matches the unsharded model
(under the generator state of the mesh's first rank, :mod:`.generator_sync`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vescale_plugins.ragged.dtensor import philox_slice
from vescale_plugins.ragged.dtensor.generator_sync import default_generator, sync_generator_once
from vescale_plugins.ragged.dtensor.specs import (
    aten,
    call_torch_default,
    has_ragged,
    other_dims_slice,
    ragged_placement,
)

RANDOM_INPLACE = (
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # a Python keyword
    aten.random_.to,
)


# Ops drawn slice by slice: on CPU in consecutive pieces, whose draws equal one draw of the
# whole tensor (see _draw_local_part_of_full): uniform_ takes one draw per element; normal_
# fills 16 elements from 16 uniforms, and recomputes the last 16 of a tensor whose size is not a
# multiple of 16. On CUDA in windows of the full draw's Philox counters (.philox_slice).
_SLICED = (aten.uniform_.default, aten.normal_.default)
_CUDA_SLICED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements per piece (a multiple of 16); the temporary is at most twice this (512 KiB in fp32).
_RANDOM_PIECE = 1 << 16


def random_inplace_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """Fill a ragged shard with its slice of a full-tensor draw from the default generator.

    Every rank draws as if it drew the whole tensor with the same generator state, so sharded
    ``reset_parameters()`` after meta-device init gives exactly the eager model's values at
    every world size; the first such op after ``fully_shard`` gives every rank of the mesh its
    first rank's generator state (:mod:`.generator_sync`), so other ranks' seeds do not
    matter. ``uniform_`` and ``normal_`` (what ``reset_parameters`` and ``nn.init`` use) on a
    tensor cut only by the RaggedShard (replicated on other mesh dims) draw no full-size
    tensor: on CPU in pieces of at most ``2 * _RANDOM_PIECE`` elements, on CUDA in windows of
    about one grid stride (:mod:`.philox_slice`), keeping only this rank's slice. Other ops,
    devices and placements draw the full tensor once. Every way leaves the generator where
    the full draw leaves it.
    """
    target = args[0]
    if not (isinstance(target, DTensor) and has_ragged(target.placements)):
        return call_torch_default(op_call, args, kwargs)
    i, ragged = ragged_placement(target.placements)
    rank = target.device_mesh.get_local_rank(i)
    local = target._local_tensor
    if local.device.type != "meta" and kwargs.get("generator") is None:
        sync_generator_once(target.device_mesh, local.device)
    if op_call in _SLICED and target.ndim and all(j == i or p.is_replicate() for j, p in enumerate(target.placements)):
        start, numel = ragged.layout(target.shape).slices[rank].offset, target.numel()
        if local.device.type == "cpu":
            _draw_local_part_of_full(op_call, local.view(-1), start, numel, args[1:], kwargs)
            return target
        if local.device.type == "cuda" and torch.version.hip is None and local.dtype in _CUDA_SLICED_DTYPES:
            generator = kwargs.get("generator") or default_generator(local.device)
            most = philox_slice.max_threads(local.device)
            philox_slice.draw_slice(
                op_call, local.view(-1), start, numel, args[1:], kwargs, generator, most, _RANDOM_PIECE
            )
            return target
    full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
    op_call(full, *args[1:], **kwargs)
    local.copy_(ragged.split_full(other_dims_slice(full, target.placements, target.device_mesh).contiguous(), rank))
    return target


def _draw_local_part_of_full(op: Any, out: torch.Tensor, start: int, numel: int, args: tuple, kwargs: dict) -> None:
    """``out`` = elements ``[start, start + out.numel())`` of ``op`` applied to a fresh tensor of
    ``numel`` elements, drawn in pieces (all but the last a multiple of 16 elements; the last
    between one and two pieces long, so a tail recomputation stays inside it)."""
    stop = start + out.numel()
    piece = torch.empty(min(numel, 2 * _RANDOM_PIECE), dtype=out.dtype, device=out.device)
    position = 0
    while position < numel:
        size = _RANDOM_PIECE if numel - position >= 2 * _RANDOM_PIECE else numel - position
        drawn = piece[:size]
        op(drawn, *args, **kwargs)  # also where nothing is kept: the generator must advance alike
        low, high = max(position, start), min(position + size, stop)
        if low < high:
            out[low - start : high - start].copy_(drawn[low - position : high - position])
        position += size

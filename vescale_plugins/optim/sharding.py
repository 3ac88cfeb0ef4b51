"""Where a parameter's shard sits in the full tensor, and the DTensors its state is stored as.

Optimizer state lives in flat buffers (one per contiguous run of parameters); each
parameter's entries in ``optimizer.state`` are views of them. For a DTensor parameter the
entries are DTensors too: element-wise state (fp32 moments, 8-bit codes) takes the
parameter's own placement; per-tile scales get a ``RaggedShard`` over tile rows whose
units match the parameter's rows, so DCP saves and reshards them like any DTensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from vescale_plugins.optim.tiles import TileGrid
from vescale_plugins.ragged.dtensor import make_dtensor
from vescale_plugins.ragged.placement import RaggedShard

__all__ = ["row_starts", "check_tiles_whole", "wrap_like", "scales_dtensor", "scale_shape"]


def row_starts(param: DTensor) -> list[tuple[int, int]] | None:
    """``(first element, elements)`` of every rank's shard on a 1-D mesh; ``None`` if replicated.

    Raises ``ValueError`` for placements the tile rule cannot follow.
    """
    if param.device_mesh.ndim != 1:
        raise ValueError(f"a parameter on a {param.device_mesh.ndim}-D mesh: 8-bit state supports 1-D meshes only")
    placement = param.placements[0]
    if isinstance(placement, Replicate):
        return None
    if isinstance(placement, RaggedShard):
        return [(s.offset, s.length) for s in placement.layout(param.shape).slices]
    if isinstance(placement, Shard) and placement.dim == 0 and param.dim() >= 1:
        world = param.device_mesh.size(0)
        rows, row_numel = param.shape[0], math.prod(param.shape[1:])
        chunk = -(-rows // world)
        return [
            (min(r * chunk, rows) * row_numel, (min((r + 1) * chunk, rows) - min(r * chunk, rows)) * row_numel)
            for r in range(world)
        ]
    raise ValueError(f"placement {placement} is not supported by 8-bit state; shard with vescale_plugins.fully_shard")


def check_tiles_whole(name: str, param: torch.Tensor, tile: int) -> None:
    """Raise ``ValueError`` naming ``name`` and the fix unless every rank's shard holds whole tiles."""
    if not isinstance(param, DTensor) or param.dim() == 0:
        return
    slices = row_starts(param)
    if slices is None:
        return
    grid = TileGrid.of(param.shape, tile)
    unit = grid.tile_h * grid.cols if param.dim() >= 2 else grid.tile_w
    for rank, (offset, length) in enumerate(slices):
        if length and offset % unit:
            where = f"row {offset // grid.cols}" if param.dim() >= 2 else f"element {offset}"
            raise ValueError(
                f"{name} (shape {tuple(param.shape)}, placement {param.placements[0]}): the shard of "
                f"rank {rank} starts at {where}, inside a {tile}x{tile} tile, so the tile's 8-bit state "
                f"would be split across ranks; shard the model with "
                f"fully_shard(..., block_size_fn=vescale_plugins.optim.tile_rows({tile}))"
            )


def scale_shape(shape: torch.Size | tuple[int, ...], tile: int) -> tuple[int, ...]:
    """Shape of a tensor's scales: ``(tile rows, tile cols)`` (2-D+), ``(blocks,)`` (1-D), ``()``."""
    grid = TileGrid.of(shape, tile)
    if len(shape) >= 2:
        return (grid.tile_rows, grid.tile_cols)
    if len(shape) == 1:
        return (grid.tile_cols,)
    return ()


def wrap_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as element-wise state of ``param``: a DTensor with its placement, or itself."""
    if not isinstance(param, DTensor):
        return local
    return make_dtensor(local, param.device_mesh, param.placements, param.shape, param.stride())


def scales_dtensor(local: torch.Tensor, param: torch.Tensor, tile: int) -> torch.Tensor:
    """``local`` (this rank's scales) as a DTensor whose shards follow ``param``'s rows."""
    if not isinstance(param, DTensor):
        return local
    shape = scale_shape(param.shape, tile)
    slices = row_starts(param)
    placements: Sequence[Placement]
    if slices is None or param.dim() == 0:
        placements = param.placements
    else:
        unit = TileGrid.of(param.shape, tile).tile_h * math.prod(param.shape[1:]) if param.dim() >= 2 else tile * tile
        placements = [RaggedShard((0,), tuple(-(-length // unit) for _, length in slices))]
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return make_dtensor(local, param.device_mesh, placements, torch.Size(shape), stride)

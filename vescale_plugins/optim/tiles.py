"""How block-wise 8-bit optimizer state tiles a parameter, and how to ask ``fully_shard`` for it.

The rule (all counts in elements or rows, as named):

* A parameter with 2 or more dims is viewed as ``rows x cols`` (``rows = shape[0]``, ``cols``
  the product of the rest) and cut into ``tile x tile`` tiles from its top-left corner; the
  tiles on the bottom and right edges are shorter or narrower (partial tiles).
* A 1-D parameter is cut into contiguous blocks of ``tile * tile`` elements from its start,
  the last one shorter (the same number of elements as a full tile).
* A 0-D parameter is one block of one element.

Every block gets one fp32 scale (its absmax). A sharded parameter's local shard must hold
whole tiles: it must start on a multiple of ``tile`` rows (``tile * tile`` elements for 1-D)
from the tensor's start, which ``fully_shard(..., block_size_fn=tile_rows(tile))`` guarantees.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["TILE", "TileGrid", "tile_rows"]

TILE = 32


def tile_rows(tile: int = TILE) -> Callable[[str, torch.nn.Parameter], int | None]:
    """A ``block_size_fn`` for ``fully_shard`` that keeps every ``tile x tile`` tile on one rank.

    Returns ``tile`` rows for parameters with 2+ dims, ``tile * tile`` for 1-D ones (their
    rows are elements) and ``None`` (one element) for 0-D ones.
    """
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile_rows(tile={tile!r}): tile must be a positive int")

    def block_size_fn(name: str, param: torch.nn.Parameter) -> int | None:
        if param.dim() >= 2:
            return tile
        if param.dim() == 1:
            return tile * tile
        return None

    return block_size_fn


@dataclass(frozen=True)
class TileGrid:
    """The tiles of one (local part of a) parameter viewed as a ``rows x cols`` matrix.

    ``tile_rows``/``tile_cols``: tiles down and across; ``tile_h``/``tile_w``: a full tile's
    height and width (``1 x tile*tile`` blocks for 1-D tensors, whose matrix is one row per
    block). ``num_tiles`` scales belong to it, stored row-major as ``(tile_rows, tile_cols)``.
    """

    rows: int
    cols: int
    tile_h: int
    tile_w: int

    @property
    def tile_rows(self) -> int:
        return -(-self.rows // self.tile_h)

    @property
    def tile_cols(self) -> int:
        return -(-self.cols // self.tile_w)

    @property
    def num_tiles(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @staticmethod
    def of(shape: torch.Size | tuple[int, ...], tile: int = TILE) -> TileGrid:
        """The grid of a tensor of ``shape`` (a local shard's shape tiles the same way)."""
        if len(shape) >= 2:
            return TileGrid(shape[0], math.prod(shape[1:]), tile, tile)
        if len(shape) == 1:
            # Contiguous blocks of tile*tile elements: a matrix of 1 x n, tiles of 1 x tile^2.
            return TileGrid(1, shape[0], 1, tile * tile)
        return TileGrid(1, 1, 1, 1)

    def matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (``numel`` elements) as the ``rows x cols`` matrix the tiles cut."""
        return flat.view(self.rows, self.cols)

"""Dequantise -> AdamW -> requantise on whole tiles, vectorised in torch (CPU and reference).

A parameter (or its local shard) is a ``rows x cols`` matrix cut into tiles
(:class:`vescale_plugins.optim.tiles.TileGrid`). Each moment is stored as uint8 codes of the
matrix's shape plus one fp32 scale (the tile's absmax) per tile; the first moment uses the
signed dynamic map, the second the unsigned one (bitsandbytes, torchao). The matrix splits
into at most four regions of equal-sized tiles (the full tiles, the right edge, the bottom
edge, the corner); each region is a strided 4-D view ``(tiles down, tile height, tiles across,
tile width)``, so a whole region steps with one chain of torch ops and no copies of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .quant_map import SCALE_FLOOR, dequantize, quantize

__all__ = ["AdamHyper", "adam8bit_step_", "tile_regions"]

# Elements per band of tile rows stepped at once: a few fp32 temporaries of this size live
# during the step (1 MiB each), whatever the parameter's size.
_BAND_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class AdamHyper:
    """One step's hyperparameters (``step`` counts from 1, after this step's increment).

    ``decoupled``: AdamW's weight decay (``p *= 1 - lr * wd``) instead of Adam's L2 term
    (``g += wd * p``).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    decoupled: bool = True

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1 - self.beta2**self.step)


def tile_regions(rows: int, cols: int, tile_h: int, tile_w: int) -> list[tuple[slice, slice, int, int, int, int, slice, slice]]:
    """Regions of equal tiles: ``(row slice, col slice, tiles down, tile h, tiles across, tile w,
    scale row slice, scale col slice)`` for the full tiles and the partial edges."""
    full_rows, full_cols = rows // tile_h, cols // tile_w
    split_r, split_c = full_rows * tile_h, full_cols * tile_w
    row_parts = [(slice(0, split_r), full_rows, tile_h, slice(0, full_rows))]
    if split_r < rows:
        row_parts.append((slice(split_r, rows), 1, rows - split_r, slice(full_rows, full_rows + 1)))
    col_parts = [(slice(0, split_c), full_cols, tile_w, slice(0, full_cols))]
    if split_c < cols:
        col_parts.append((slice(split_c, cols), 1, cols - split_c, slice(full_cols, full_cols + 1)))
    return [
        (rs, cs, nr, th, nc, tw, srs, scs)
        for rs, nr, th, srs in row_parts if nr
        for cs, nc, tw, scs in col_parts if nc
    ]


def adam8bit_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
    tile_h: int,
    tile_w: int,
    hyper: AdamHyper,
) -> None:
    """One fused step on a ``rows x cols`` matrix, in place.

    ``param``, ``grad`` and the codes are ``rows x cols`` (views are fine); the scales are
    ``(ceil(rows / tile_h), ceil(cols / tile_w))`` fp32. The moments are dequantised, updated
    in fp32 as ``torch.optim.AdamW`` does, used for the parameter update, then requantised with
    fresh per-tile absmax scales.
    """
    rows, cols = param.shape
    for rs, cs, nr, th, nc, tw, srs, scs in tile_regions(rows, cols, tile_h, tile_w):
        # Bands of whole tile rows bound the fp32 temporaries (and keep them in cache).
        band = max(1, _BAND_ELEMENTS // max(1, th * (cs.stop - cs.start)))
        for first in range(0, nr, band):
            count = min(band, nr - first)
            r = slice(rs.start + first * th, rs.start + (first + count) * th)
            sr = slice(srs.start + first, srs.start + first + count)
            shape = (count, th, nc, tw)
            _step_region(
                param[r, cs].view(shape), grad[r, cs].view(shape),
                exp_avg_codes[r, cs].view(shape), exp_avg_scales[sr, scs],
                exp_avg_sq_codes[r, cs].view(shape), exp_avg_sq_scales[sr, scs], hyper,
            )


def _step_region(p, g, m_codes, m_scales, v_codes, v_scales, hyper: AdamHyper) -> None:
    per_tile = (slice(None), None, slice(None), None)
    m = dequantize(m_codes, signed=True).mul_(m_scales[per_tile])
    v = dequantize(v_codes, signed=False).mul_(v_scales[per_tile])
    grad = g.float()
    p32 = p if p.dtype == torch.float32 else p.float()
    if hyper.decoupled:
        p32.mul_(1 - hyper.lr * hyper.weight_decay)
    elif hyper.weight_decay:
        grad = grad.add(p32, alpha=hyper.weight_decay)
    m.lerp_(grad, 1 - hyper.beta1)
    v.mul_(hyper.beta2).addcmul_(grad, grad, value=1 - hyper.beta2)
    denom = v.sqrt().div_(hyper.bias_correction2_sqrt).add_(hyper.eps)
    p32.addcdiv_(m, denom, value=-hyper.step_size)
    if p32 is not p:
        p.copy_(p32)
    _requantize_(m, m_codes, m_scales, signed=True)
    _requantize_(v, v_codes, v_scales, signed=False)


def _requantize_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    absmax = values.abs().amax(dim=(1, 3)).clamp_min_(SCALE_FLOOR)
    scales.copy_(absmax)
    codes.copy_(quantize(values.div_(absmax[:, None, :, None]), signed))

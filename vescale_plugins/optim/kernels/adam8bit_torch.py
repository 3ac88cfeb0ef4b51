"""Dequantise -> AdamW -> requantise on whole tiles, vectorised in torch (CPU and reference).

A parameter (or its local shard) is a ``rows x cols`` matrix cut into tiles
(:class:`vescale_plugins.optim.tiles.TileGrid`). Each moment is stored as uint8 codes of the
matrix's shape plus one fp32 scale (the tile's absmax) per tile; the first moment uses the
signed dynamic map, the second the unsigned one (bitsandbytes, torchao).

The step walks bands of whole tile rows (full width, so contiguous); per band, about a dozen
tensor passes: each moment is dequantised into an fp32 temporary (a table lookup, then one
multiply per region of equal tiles), ``torch._fused_adamw_`` (``_fused_adam_`` for L2 decay)
updates parameter and moments in one pass, and each moment is requantised (absmax per tile,
one divide per region, the bucketed code lookup of :func:`.quant_map.quantize`). The regions
(at most four: the full tiles, the right edge, the bottom edge, the corner) are strided 4-D
views ``(tiles down, tile height, tiles across, tile width)``, so no tile needs a Python loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vescale_plugins.optim.kernels.quant_map import SCALE_FLOOR, dynamic_map, quantize

__all__ = ["AdamHyper", "adam8bit_step_", "step_tensor", "tile_regions"]

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


def tile_regions(
    rows: int, cols: int, tile_h: int, tile_w: int
) -> list[tuple[slice, slice, int, int, int, int, slice, slice]]:
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
        (rs, cs, nr, th, nc, tw, srs, scs) for rs, nr, th, srs in row_parts if nr for cs, nc, tw, scs in col_parts if nc
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
    state = (exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales)
    if (
        rows == 1
        and tile_h == 1
        and cols > tile_w
        and all(t.is_contiguous() for t in (param, exp_avg_codes, exp_avg_sq_codes))
    ):
        # 1-D blocks: the full ones as the rows of a (blocks x tile_w) matrix, so they band.
        full = cols // tile_w
        rest = (slice(None), slice(full * tile_w, cols))
        grad = grad.contiguous()
        _step_bands(
            param[0, : full * tile_w].view(full, tile_w),
            grad[0, : full * tile_w].view(full, tile_w),
            exp_avg_codes[0, : full * tile_w].view(full, tile_w),
            exp_avg_scales[0, :full].view(full, 1),
            exp_avg_sq_codes[0, : full * tile_w].view(full, tile_w),
            exp_avg_sq_scales[0, :full].view(full, 1),
            1,
            tile_w,
            hyper,
        )
        if full * tile_w < cols:
            tail = (slice(None), slice(full, full + 1))
            _step_bands(
                param[rest],
                grad[rest],
                exp_avg_codes[rest],
                exp_avg_scales[tail],
                exp_avg_sq_codes[rest],
                exp_avg_sq_scales[tail],
                1,
                tile_w,
                hyper,
            )
        return
    _step_bands(param, grad, *state, tile_h, tile_w, hyper)


def _step_bands(param, grad, m_codes, m_scales, v_codes, v_scales, tile_h: int, tile_w: int, hyper: AdamHyper) -> None:
    rows, cols = param.shape
    # Bands of whole tile rows bound the fp32 temporaries (and keep them in cache).
    band = max(1, _BAND_ELEMENTS // max(1, tile_h * cols))
    tile_rows = -(-rows // tile_h)
    for first in range(0, tile_rows, band):
        r = slice(first * tile_h, min(rows, (first + band) * tile_h))
        s = slice(first, first + band)
        _step_band(param[r], grad[r], m_codes[r], m_scales[s], v_codes[r], v_scales[s], tile_h, tile_w, hyper)


def _step_band(p, g, m_codes, m_scales, v_codes, v_scales, tile_h: int, tile_w: int, hyper: AdamHyper) -> None:
    regions = tile_regions(p.shape[0], p.shape[1], tile_h, tile_w)
    m = _dequantize_tiles(m_codes, m_scales, regions, signed=True)
    v = _dequantize_tiles(v_codes, v_scales, regions, signed=False)
    # The fused kernel wants contiguous tensors of one dtype: fp32 copies where needed.
    p32 = p if p.dtype == torch.float32 and p.is_contiguous() else p.float().contiguous()
    g32 = g if g.dtype == torch.float32 and g.is_contiguous() else g.float().contiguous()
    fused = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    fused(
        [p32],
        [g32],
        [m],
        [v],
        [],
        [step_tensor(hyper.step, p32.device)],
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
        grad_scale=None,
        found_inf=None,
    )
    if p32 is not p:
        p.copy_(p32)
    _requantize_(m, m_codes, m_scales, regions, signed=True)
    _requantize_(v, v_codes, v_scales, regions, signed=False)


def step_tensor(step: int, device: torch.device) -> torch.Tensor:
    """The fused Adam kernels' step count on ``device``: filled there (a kernel with the
    value as its argument), not copied from the host, which would sync on CUDA."""
    return torch.full((), float(step), dtype=torch.float32, device=device)


def _region_views(values: torch.Tensor, scales: torch.Tensor, region) -> tuple[torch.Tensor, torch.Tensor]:
    """A region as ``(tiles down, tile h, tiles across, tile w)`` and its scales broadcast to it."""
    rs, cs, nr, th, nc, tw, srs, scs = region
    return values[rs, cs].view(nr, th, nc, tw), scales[srs, scs][:, None, :, None]


def _dequantize_tiles(codes: torch.Tensor, scales: torch.Tensor, regions, signed: bool) -> torch.Tensor:
    """A new contiguous fp32 tensor of the moment's values (map value x its tile's scale)."""
    values = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    index = torch.empty(codes.shape, dtype=torch.int32, device=codes.device)
    index.copy_(codes)
    torch.index_select(dynamic_map(signed, codes.device), 0, index.view(-1), out=values.view(-1))
    for region in regions:
        tiles, tile_scales = _region_views(values, scales, region)
        tiles.mul_(tile_scales)
    return values


def _requantize_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, regions, signed: bool) -> None:
    """New per-tile absmax ``scales`` and ``codes`` of ``values`` (which is overwritten)."""
    for region in regions:
        tiles, _ = _region_views(values, scales, region)
        # The second moment is never negative: its absmax is its max (no |x| pass). Reducing
        # one dim at a time is several times faster than amax over (1, 3) at once.
        magnitudes = tiles.abs() if signed else tiles
        absmax = magnitudes.amax(dim=1).amax(dim=2)
        rs, cs, nr, th, nc, tw, srs, scs = region
        scales[srs, scs] = absmax.clamp_min_(SCALE_FLOOR)
        tiles.div_(absmax[:, None, :, None])
    quantize(values, signed, out=codes)

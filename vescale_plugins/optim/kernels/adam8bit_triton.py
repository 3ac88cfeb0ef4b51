"""Dequantise -> AdamW -> requantise per tile in Triton: one launch steps a whole run.

One program per tile. A per-run table (int64, one row per tile: first element, row stride,
height, width, elements, scale index) lets one launch cover every tile of every parameter in
a flat run (:mod:`vescale_plugins.optim.flat`), including the partial edge tiles. Lanes are a
``(BLOCK, BLOCK)`` block (``BLOCK`` a power of two, a compile-time constant, not below the
tile side): lane ``(r, c)`` is element ``start + r * stride + c``, so a row's lanes are
contiguous and, with the alignment the table guarantees (``ALIGN``), loaded as vectors. A 1-D
block of ``tile * tile`` elements (and a 0-D parameter's one element) is folded into rows of
``tile``, masked by its element count.

The math and the code rule are the torch reference's (:mod:`.adam8bit_torch`,
:mod:`.quant_map`): the code is one gather from the reference's bucket table, an add and a
shift, so a normalised value gets the reference's code bit for bit; the square root and the
divisions are correctly rounded (``sqrt_rn``, ``div_rn``, what the interpreter and CUDA's
fused Adam compute, not the approximations ``tl.sqrt`` and ``/`` compile to), and fused
multiply-adds may still move a value across a rounding boundary, so codes agree with the
reference to within one step. CI runs it on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vescale_plugins.optim.kernels.adam8bit_torch import AdamHyper
from vescale_plugins.optim.kernels.quant_map import BUCKET_SHIFT, BUCKETS, SCALE_FLOOR, bucket_table, dynamic_map

__all__ = ["TileTable", "adam8bit_tiles_", "tile_table"]

_TABLE_COLUMNS = 6
# The largest alignment (in elements) worth asserting: 16 uint8 codes are one 16-byte load.
_MAX_ALIGN = 16
_SHIFT = tl.constexpr(BUCKET_SHIFT)
_BUCKET_MASK = tl.constexpr(BUCKETS - 1)
_LOW = tl.constexpr((1 << BUCKET_SHIFT) - 1)


@triton.jit
def _code(x, table_ptr, SIGNED: tl.constexpr):
    """:func:`.quant_map.quantize`'s rule: the value's bucket (its top bits) from the table,
    plus its place in the bucket (its low bits, mirrored for negative floats), shifted."""
    bits = x.to(tl.int32, bitcast=True)
    bucket = (bits >> _SHIFT) & _BUCKET_MASK
    if SIGNED:
        position = ((bits >> 31) ^ bits) & _LOW
    else:  # the unsigned map's thresholds are all positive: negative floats' buckets hold none
        position = bits & _LOW
    return (tl.load(table_ptr + bucket) + position) >> _SHIFT


@triton.jit
def _adam8bit_tile_kernel(
    p_ptr,
    g_ptr,
    mc_ptr,
    ms_ptr,
    vc_ptr,
    vs_ptr,
    qs_ptr,
    qu_ptr,
    ts_ptr,
    tu_ptr,
    table_ptr,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step_size,
    bias_correction2_sqrt,
    scale_floor,
    DECOUPLED: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    tile = tl.program_id(0)
    row = table_ptr + tile * 6
    start = tl.multiple_of(tl.load(row), ALIGN)
    stride = tl.multiple_of(tl.load(row + 1), ALIGN)
    height = tl.load(row + 2)
    width = tl.multiple_of(tl.load(row + 3), ALIGN)
    count = tl.multiple_of(tl.load(row + 4), ALIGN)
    scale_index = tl.load(row + 5)
    r = tl.arange(0, BLOCK)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    local = r * stride + c
    mask = (r < height) & (c < width) & (local < count)
    offsets = start + local
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m_code = tl.load(mc_ptr + offsets, mask=mask, other=0).to(tl.int32)
    v_code = tl.load(vc_ptr + offsets, mask=mask, other=0).to(tl.int32)
    m = tl.load(qs_ptr + m_code) * tl.load(ms_ptr + scale_index)
    v = tl.load(qu_ptr + v_code) * tl.load(vs_ptr + scale_index)
    if DECOUPLED:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
    m_scale = tl.maximum(tl.max(tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1), axis=0), scale_floor)
    v_scale = tl.maximum(tl.max(tl.max(tl.where(mask, v, 0.0), axis=1), axis=0), scale_floor)
    tl.store(ms_ptr + scale_index, m_scale)
    tl.store(vs_ptr + scale_index, v_scale)
    tl.store(mc_ptr + offsets, _code(tl.div_rn(m, m_scale), ts_ptr, True).to(tl.uint8), mask=mask)
    tl.store(vc_ptr + offsets, _code(tl.div_rn(v, v_scale), tu_ptr, False).to(tl.uint8), mask=mask)


@dataclass(frozen=True)
class TileTable:
    """A run's tile table on its device, the lane block's side and the alignment (in
    elements) of every start, row stride, width and element count in it."""

    table: torch.Tensor
    block: int
    align: int


def tile_table(
    members: list[tuple[int, tuple[int, int], int]],
    tile_h_w: list[tuple[int, int]],
    tile: int,
    device: torch.device | str,
) -> TileTable:
    """The tile table of a run. ``members``: ``(element offset, (rows, cols), first scale
    index)`` per parameter; ``tile_h_w``: each one's full tile height and width
    (:class:`vescale_plugins.optim.tiles.TileGrid`: ``(tile, tile)``, or ``(1, tile * tile)``
    and ``(1, 1)`` for the blocks of 1-D and 0-D parameters, which are folded into rows of
    ``tile``)."""
    parts = []
    for (offset, (rows, cols), scale_start), (th, tw) in zip(members, tile_h_w):
        if rows * cols == 0:
            continue
        tr, tc = -(-rows // th), -(-cols // tw)
        ti = torch.arange(tr).repeat_interleave(tc)
        tj = torch.arange(tc).repeat(tr)
        height = torch.clamp(rows - ti * th, max=th)
        width = torch.clamp(cols - tj * tw, max=tw)
        if (th, tw) == (tile, tile):
            columns = [offset + ti * th * cols + tj * tw, torch.full_like(ti, cols), height, width, height * cols]
        elif rows == 1 and th == 1 and tw in (tile * tile, 1):
            elements = width  # a block of one row, folded into rows of `tile`
            columns = [
                offset + tj * tw,
                torch.full_like(ti, tile),
                -(-elements // tile),
                torch.clamp(elements, max=tile),
                elements,
            ]
        else:
            raise ValueError(f"tile_table: tiles of {th} x {tw} are not tiles of side {tile} (TileGrid's)")
        parts.append(torch.stack([*columns, scale_start + ti * tc + tj], dim=1))
    table = torch.cat(parts) if parts else torch.zeros((0, _TABLE_COLUMNS), dtype=torch.int64)
    # Each entry's largest power-of-two divisor up to _MAX_ALIGN; the smallest one holds for all.
    divisors = torch.gcd(table[:, :5].flatten(), torch.tensor(_MAX_ALIGN))
    align = int(divisors.min()) if divisors.numel() else _MAX_ALIGN
    block = triton.next_power_of_2(tile)
    return TileTable(table.to(device=device, dtype=torch.int64).contiguous(), block, align)


def adam8bit_tiles_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
    tiles: TileTable,
    hyper: AdamHyper,
) -> None:
    """Step every tile listed in ``tiles`` (all tensors contiguous, indexed as flat)."""
    if tiles.table.shape[0] == 0:
        return
    for t in (param, grad, exp_avg_codes, exp_avg_sq_codes, exp_avg_scales, exp_avg_sq_scales):
        if not t.is_contiguous():
            raise ValueError("adam8bit_tiles_ needs contiguous tensors")
    device = param.device
    _adam8bit_tile_kernel[(tiles.table.shape[0],)](
        param,
        grad,
        exp_avg_codes,
        exp_avg_scales,
        exp_avg_sq_codes,
        exp_avg_sq_scales,
        dynamic_map(True, device),
        dynamic_map(False, device),
        bucket_table(True, device),
        bucket_table(False, device),
        tiles.table,
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.eps,
        hyper.weight_decay,
        hyper.step_size,
        hyper.bias_correction2_sqrt,
        SCALE_FLOOR,
        DECOUPLED=hyper.decoupled,
        BLOCK=tiles.block,
        ALIGN=tiles.align,
    )

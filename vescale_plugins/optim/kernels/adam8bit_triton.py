"""Dequantise -> AdamW -> requantise per tile in Triton: one launch steps a whole run.

One program per tile. A per-run table (int64, one row per tile: first element, row stride,
height, width, nominal width, scale index) lets one launch cover every tile of every
parameter in a flat run (:mod:`vescale_plugins.optim.flat`), including the partial edge
tiles and the 1-D blocks (one row of ``tile * tile``). The math and the code rule are the
torch reference's (:mod:`.adam8bit_torch`, :mod:`.quant_map`); fused multiply-adds may move a
value across a rounding boundary, so codes agree with the reference to within one step.
CI runs it on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vescale_plugins.optim.kernels.adam8bit_torch import AdamHyper
from vescale_plugins.optim.kernels.quant_map import SCALE_FLOOR, dynamic_map

__all__ = ["adam8bit_tiles_", "tile_table"]

_TABLE_COLUMNS = 6


@triton.jit
def _quantize(x, q_ptr):
    """torchao's branch-free binary search over the 256 map values, then round to nearest."""
    code = tl.where(x >= tl.load(q_ptr + 128), 128, 0)
    code += tl.where(x >= tl.load(q_ptr + code + 64), 64, 0)
    code += tl.where(x >= tl.load(q_ptr + code + 32), 32, 0)
    code += tl.where(x >= tl.load(q_ptr + code + 16), 16, 0)
    code += tl.where(x >= tl.load(q_ptr + code + 8), 8, 0)
    code += tl.where(x >= tl.load(q_ptr + code + 4), 4, 0)
    code += tl.where(x >= tl.load(q_ptr + code + 2), 2, 0)
    code += tl.where(x >= tl.load(q_ptr + code + 1), 1, 0)
    up = tl.minimum(code + 1, 255)
    down_value = tl.load(q_ptr + code)
    up_value = tl.load(q_ptr + up)
    return tl.where(x - down_value >= (up_value - down_value) * 0.5, up, code)


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
):
    tile = tl.program_id(0)
    row = table_ptr + tile * 6
    start = tl.load(row)
    stride = tl.load(row + 1)
    height = tl.load(row + 2)
    width = tl.load(row + 3)
    nominal_width = tl.load(row + 4)
    scale_index = tl.load(row + 5)
    lane = tl.arange(0, BLOCK)
    r = lane // nominal_width
    c = lane % nominal_width
    mask = (r < height) & (c < width)
    offsets = start + r * stride + c
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
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
    m_scale = tl.maximum(tl.max(tl.where(mask, tl.abs(m), 0.0), axis=0), scale_floor)
    v_scale = tl.maximum(tl.max(tl.where(mask, v, 0.0), axis=0), scale_floor)
    tl.store(ms_ptr + scale_index, m_scale)
    tl.store(vs_ptr + scale_index, v_scale)
    tl.store(mc_ptr + offsets, _quantize(m / m_scale, qs_ptr).to(tl.uint8), mask=mask)
    tl.store(vc_ptr + offsets, _quantize(v / v_scale, qu_ptr).to(tl.uint8), mask=mask)


def tile_table(
    members: list[tuple[int, tuple[int, int], int]], tile_h_w: list[tuple[int, int]], device: torch.device
) -> torch.Tensor:
    """The per-tile table of a run. ``members``: ``(element offset, (rows, cols), first scale
    index)`` per parameter; ``tile_h_w``: each one's full tile height and width."""
    parts = []
    for (offset, (rows, cols), scale_start), (th, tw) in zip(members, tile_h_w):
        if rows * cols == 0:
            continue
        tr, tc = -(-rows // th), -(-cols // tw)
        ti = torch.arange(tr).repeat_interleave(tc)
        tj = torch.arange(tc).repeat(tr)
        part = torch.stack(
            [
                offset + ti * th * cols + tj * tw,
                torch.full_like(ti, cols),
                torch.clamp(rows - ti * th, max=th),
                torch.clamp(cols - tj * tw, max=tw),
                torch.full_like(ti, tw),
                scale_start + ti * tc + tj,
            ],
            dim=1,
        )
        parts.append(part)
    table = torch.cat(parts) if parts else torch.zeros((0, _TABLE_COLUMNS), dtype=torch.int64)
    return table.to(device=device, dtype=torch.int64).contiguous()


def adam8bit_tiles_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
    table: torch.Tensor,
    max_tile_numel: int,
    hyper: AdamHyper,
) -> None:
    """Step every tile listed in ``table`` (all tensors contiguous, indexed as flat)."""
    if table.shape[0] == 0:
        return
    for t in (param, grad, exp_avg_codes, exp_avg_sq_codes, exp_avg_scales, exp_avg_sq_scales):
        if not t.is_contiguous():
            raise ValueError("adam8bit_tiles_ needs contiguous tensors")
    device = param.device
    _adam8bit_tile_kernel[(table.shape[0],)](
        param,
        grad,
        exp_avg_codes,
        exp_avg_scales,
        exp_avg_sq_codes,
        exp_avg_sq_scales,
        dynamic_map(True, device),
        dynamic_map(False, device),
        table,
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.eps,
        hyper.weight_decay,
        hyper.step_size,
        hyper.bias_correction2_sqrt,
        SCALE_FLOOR,
        DECOUPLED=hyper.decoupled,
        BLOCK=triton.next_power_of_2(max_tile_numel),
    )

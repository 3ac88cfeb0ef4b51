"""Shared by the quantized-collective tests: the one-rank reference of block-wise int8
quantization, and a small stack of layers to train with and without it."""

from __future__ import annotations

import torch
import torch.nn as nn

from vescale_plugins.dbuffer.planning import quantization_block


def _blocks(full: torch.Tensor, block: int) -> torch.Tensor:
    """``full`` flat in rows of its quantization blocks (the last zero-padded)."""
    run = quantization_block(full.shape, block)
    x = full.detach().float().reshape(-1)
    return torch.cat([x, x.new_zeros(-x.numel() % run)]).view(-1, run)


def reference(full: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Block-wise symmetric int8 quantize-dequantize of a whole tensor on one rank: runs of
    ``quantization_block(shape, block)`` elements from its first, one scale (amax / 127) each."""
    blocks = _blocks(full, block)
    scale = blocks.abs().amax(1, keepdim=True) / 127
    codes = (blocks / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127)
    return (codes * scale).reshape(-1)[: full.numel()].view(full.shape).to(dtype)


def reference_scales(full: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block scale (amax / 127) in :func:`reference`."""
    blocks = _blocks(full, block)
    scale = (blocks.abs().amax(1, keepdim=True) / 127).expand_as(blocks)
    return scale.reshape(-1)[: full.numel()].view(full.shape)


class Stack(nn.Module):
    """``layers`` tanh(Linear(width, width)) layers."""

    def __init__(self, width: int = 256, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

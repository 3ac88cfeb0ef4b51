"""Weights with FSDP2's all-gather extensions, for tests: float8-style and MXFP8-style.

Both wrap a full-precision weight and all-gather it in float8 (e4m3), as torchao's float8
training and torchtitan's MXFP8 weights do:

- :class:`Float8Weight`: one scale per tensor (its amax all-reduced over the shard mesh, as
  torchao's dynamic scaling), passed as metadata; the data is the one all-gather input.
- :class:`MXFP8Weight`: one power-of-two scale per block of 32 elements along the last dim,
  gathered beside the data as a second input (float8_e8m0fnu, 1/32 of the data's numel).

``fsdp_post_all_gather`` dequantises to the compute dtype into a tensor of its own, freed at
reshard and refilled through ``out=``. ``pad_to_chunks`` pads the inputs to FSDP2's even
``Shard(0)`` chunk where the rows do not divide (FSDP2 asks it of an unevenly sharded
parameter, and then wants every input of the padded shard's shape, which per-block scales
cannot have); veScale-FSDP's shards are whole rows without padding, so it is off there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
BLOCK = 32

# The ops whose results stay weights (FSDP2 and DTensor build shards, views and copies with
# them); everything else (optimizer math, reductions) gives plain tensors, as torchao's.
_PRESERVED = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


class _QuantizedAllGatherWeight(torch.Tensor):
    @staticmethod
    def __new__(cls, data: torch.Tensor, pad_to_chunks: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor, pad_to_chunks: bool = False):
        self._data = data
        self._pad_to_chunks = pad_to_chunks

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        pads = {t._pad_to_chunks for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)}
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        (pad,) = pads
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, pad), out)

    def __tensor_flatten__(self):
        return ["_data"], self._pad_to_chunks

    @classmethod
    def __tensor_unflatten__(cls, inner, pad, outer_size, outer_stride):
        return cls(inner["_data"], pad)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data})"

    def _padded(self, tensor: torch.Tensor, outer_size: torch.Size, mesh: Any) -> torch.Tensor:
        """FSDP2's padded shard: ``ceil(rows / W)`` rows, this shard's first."""
        if not self._pad_to_chunks or outer_size[0] % mesh.size() == 0:
            return tensor
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]].copy_(tensor)
        return padded

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        value = self._dequantise(all_gather_outputs, metadata, param_dtype)
        if out is not None:
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(value[: out.shape[0]])
            return None
        return value, (value,)


class Float8Weight(_QuantizedAllGatherWeight):
    """All-gathered in float8 with one scale per tensor (see the module docstring)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        data = self._data
        amax = data.abs().amax() if data.numel() else data.new_zeros(())
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = (E4M3_MAX / amax.clamp(min=1e-12)).float()
        quantised = (data * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return (self._padded(quantised, outer_size, mesh),), (scale,)

    @staticmethod
    def _dequantise(outputs, metadata, param_dtype):
        ((data,), (scale,)) = outputs, metadata
        return (data.float() / scale).to(param_dtype)


class MXFP8Weight(_QuantizedAllGatherWeight):
    """All-gathered in float8 with a power-of-two scale per 32 elements of the last dim."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        data = self._data
        blocks = data.reshape(data.shape[0], data.shape[1] // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=-1)
        exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 8, torch.zeros_like(amax))
        scale = torch.exp2(exponent)
        quantised = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(data.shape)
        scales = scale.to(torch.float8_e8m0fnu)
        return (self._padded(quantised, outer_size, mesh), self._padded(scales, outer_size, mesh)), None

    @staticmethod
    def _dequantise(outputs, metadata, param_dtype):
        data, scales = outputs
        blocks = data.float().reshape(*scales.shape, BLOCK) * scales.float()[..., None]
        return blocks.reshape(data.shape).to(param_dtype)

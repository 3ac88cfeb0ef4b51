"""p-norms of ragged operands (``linalg_vector_norm``, ``_foreach_norm``): a rank that holds
no element contributes the identity instead of failing (inf-norm)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _NormPartial

from vescale_plugins.ragged.dtensor.specs import (
    call_torch_default,
    check_spec,
    has_ragged,
    is_sharding,
)


def norm_partial(norm_type: float) -> Placement:
    if norm_type == math.inf:
        return Partial("max")
    if norm_type == -math.inf:
        return Partial("min")
    if norm_type == 0:
        return Partial("sum")
    return _NormPartial(norm_type)


def _local_vector_norm(local: torch.Tensor, ord: float, dtype: torch.dtype | None) -> torch.Tensor:
    if local.numel() == 0:
        identity = math.inf if ord == -math.inf else 0.0
        out_dtype = dtype or (local.dtype if local.is_floating_point() else torch.get_default_dtype())
        return torch.full((), identity, dtype=out_dtype, device=local.device)
    return torch.linalg.vector_norm(local, ord, dtype=dtype)


def _ragged_norm_spec(spec: DTensorSpec, ord: float, out: torch.Tensor) -> DTensorSpec | None:
    if any(p.is_partial() for p in spec.placements):
        return None
    placements = tuple(norm_partial(ord) if is_sharding(p) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=TensorMeta(torch.Size(()), (), out.dtype))


def vector_norm_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    if not (isinstance(x, DTensor) and has_ragged(x.placements)) or dim not in (None, []) or keepdim:
        return call_torch_default(op_call, args, kwargs)
    check_spec(x.placements, x.device_mesh, x.shape)
    out = _local_vector_norm(x._local_tensor, float(ord), dtype)
    spec = _ragged_norm_spec(x._spec, float(ord), out)
    if spec is None:
        return call_torch_default(op_call, args, kwargs)
    return DTensor(out, spec, requires_grad=False)


def foreach_norm_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    tensors = args[0]
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if not any(isinstance(t, DTensor) and has_ragged(t.placements) for t in tensors):
        return call_torch_default(op_call, args, kwargs)
    results = []
    for t in tensors:
        if not (isinstance(t, DTensor) and has_ragged(t.placements)):
            results.append(call_torch_default(op_call, ([t], ord, dtype), {})[0])
            continue
        check_spec(t.placements, t.device_mesh, t.shape)
        out = _local_vector_norm(t._local_tensor, ord, dtype)
        spec = _ragged_norm_spec(t._spec, ord, out)
        results.append(
            DTensor(out, spec, requires_grad=False)
            if spec is not None
            else torch.linalg.vector_norm(t.full_tensor(), ord, dtype=dtype)
        )
    return results

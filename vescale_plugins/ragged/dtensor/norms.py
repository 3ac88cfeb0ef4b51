"""p-norms of ragged operands (``linalg_vector_norm``, ``_foreach_norm``): a rank that holds
no element contributes the identity instead of failing (inf-norm).

``_foreach_norm`` (``clip_grad_norm_``'s) stays one local ``_foreach_norm`` per (device,
dtype) group, as FSDP2's is: one kernel per group on CUDA, not one per parameter. A ragged
spec is checked, and its norm's spec built, once per layout (the mesh's cache)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _NormPartial

from vescale_plugins.ragged.dtensor.cache import ShardingCache
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


def _norm_specs(tensors: list[DTensor], ord: float, dtype: torch.dtype) -> list[DTensorSpec | None]:
    """Each ragged operand's norm spec (:func:`_ragged_norm_spec`, its spec checked first),
    once per (layouts, ord, dtype): one cache lookup per call, keyed on the specs' identities
    (the cached entry holds the specs, so no identity is reused while it lives)."""
    specs = [t._spec for t in tensors]
    key = ("norms", tuple([id(spec) for spec in specs]), ord, dtype)
    cache = ShardingCache.of(specs[0].mesh)

    def compute() -> tuple[list[DTensorSpec], list[DTensorSpec | None]]:
        out = torch.empty((), dtype=dtype, device="meta")
        results = []
        for spec in specs:
            check_spec(spec.placements, spec.mesh, spec.shape)
            results.append(_ragged_norm_spec(spec, ord, out))
        return specs, results

    return cache.get(key, compute)[1]


def foreach_norm_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    tensors = args[0]
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    ragged = [isinstance(t, DTensor) and has_ragged(t._spec.placements) for t in tensors]
    if not any(ragged):
        return call_torch_default(op_call, args, kwargs)
    results: list[torch.Tensor | None] = [None] * len(tensors)
    others = [i for i, is_ragged in enumerate(ragged) if not is_ragged]
    if others:
        for i, out in zip(others, call_torch_default(op_call, ([tensors[i] for i in others], ord, dtype), {})):
            results[i] = out
    indices = [i for i, is_ragged in enumerate(ragged) if is_ragged]
    locals_ = [tensors[i]._local_tensor for i in indices]
    # One local _foreach_norm per (device, dtype), empty shards in it (their p-norm is 0, as
    # FSDP2's empty shards get); for the +-inf-norms an empty shard's identity apart (the max
    # of no element is an error).
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    norms: list[torch.Tensor | None] = [None] * len(indices)
    infinite = math.isinf(ord)
    for position, local in enumerate(locals_):
        if infinite and local.numel() == 0:
            norms[position] = _local_vector_norm(local, ord, dtype)
        else:
            groups.setdefault((local.device, local.dtype), []).append(position)
    for positions in groups.values():
        for position, out in zip(positions, torch._foreach_norm([locals_[p] for p in positions], ord, dtype=dtype)):
            norms[position] = out
    # The norms' specs, once per layout, for each output dtype (gradients of several dtypes).
    done = [n for n in norms if n is not None]
    assert len(done) == len(norms)  # every ragged operand has its local norm from above
    by_dtype: dict[torch.dtype, list[int]] = {}
    for position, out in enumerate(done):
        by_dtype.setdefault(out.dtype, []).append(position)
    new = DTensor.__new__  # without DTensor.__init__'s wrappers (see wrap_local)
    for out_dtype, positions in by_dtype.items():
        specs = _norm_specs([tensors[indices[p]] for p in positions], ord, out_dtype)
        for position, spec in zip(positions, specs):
            i = indices[position]
            results[i] = (
                new(DTensor, done[position], spec, requires_grad=False)
                if spec is not None
                else torch.linalg.vector_norm(tensors[i].full_tensor(), ord, dtype=dtype)
            )
    return results

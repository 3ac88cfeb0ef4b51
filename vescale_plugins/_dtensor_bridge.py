"""Where torch's DTensor is taught about RaggedShard. Every private torch API we use is here.

DTensor has no public extension point for new placements, so we hook the few places that
interpret placements, and route a call to our code only when a RaggedShard is involved
(everything else goes to torch unchanged):

- ``OpDispatcher._propagate_op_sharding_dispatch_slow_path`` (private; called by the C++
  dispatcher on a sharding-cache miss): op rules for ragged operands. The C++ cache then
  keys on our placement's ``__hash__``/``__eq__``, so a rule runs once per layout.
- ``OpDispatcher._custom_op_handlers`` (private dict): p-norms on ragged operands, because a
  rank that holds no element must contribute the identity instead of failing (inf-norm); and
  random in-place initialisers, so sharded init draws exactly what the full tensor would.
- ``_redistribute.redistribute_local_tensor`` (private; also bound by name in ``_api`` and
  ``_dispatch``): ragged collectives for ``redistribute``, ``full_tensor`` and their backward.
- ``distribute_tensor`` (public, but placement handling is internal): ragged split. It,
  ``redistribute_local_tensor``, ``compute_local_shape_and_global_offset`` and
  ``DTensor.from_local`` are redirected in place (``_redirect``: the function object's code
  becomes a call to ours), so references taken before our import work too.
- ``DTensor.from_local`` (public): validate a ragged layout and demand the global shape.
- ``_utils.compute_local_shape_and_global_offset`` (private; bound by name in
  ``_state_dict_utils`` and DCP helpers): one box for a row-wise ragged shard.
- ``DTensor.__create_write_items__ / __create_chunk_list__ / __get_tensor_shard__``
  (DCP's checkpointable protocol): a ragged shard is described as a few regular boxes.
- ``DeviceMesh._layout`` / ``_rank_map`` (private): every copy of a submesh, for subgroups
  every rank must create (``every_copy_of_mesh``).
- ``DeviceMesh._concatenate`` (private): the (dp, tp) mesh of a tensor-parallel parameter
  sharded by FSDP, as FSDP2 builds it (``concatenate_meshes``).
- ``DTensor.__deepcopy__`` / ``__reduce_ex__`` (inherited from Tensor): torch tells a
  wrapper subclass by ``data_ptr() == 0``, which a DTensor over a view at an offset (our
  shards and their ``detach()``) misses; such a DTensor is copied/pickled through an
  offset-0 twin over the same local tensor (``_dtensor_at_offset_zero``).
Next to even ``Shard`` placements on other mesh dims (tensor/expert parallel), a RaggedShard
cuts this rank's local tensor of those dims, whatever its mesh-dim position
(``StridedRaggedShard`` names the case where, read left to right, its rows are strided):
every path above goes through ``_other_dims_box`` / ``_other_dims_local_shape`` for that.
Private types used: ``DTensorSpec``, ``TensorMeta``, ``OpSchema``, ``OutputSharding``,
``_NormPartial``, the ``DTensor(local, spec, requires_grad=)`` constructor and
``DTensor._local_tensor`` (re-pointed by ``set_local_tensor``), and
``torch._C._autograd._unsafe_set_version_counter`` (``set_version_counter``).
"""

from __future__ import annotations

import math
import types
from typing import Any, Sequence

import torch
import torch.distributed.tensor._api as dtensor_api
import torch.distributed.tensor._dispatch as dtensor_dispatch
import torch.distributed.tensor._redistribute as dtensor_redistribute
import torch.distributed.tensor._utils as dtensor_utils
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.utils import _pytree as pytree

from . import ragged_collectives as rc
from .placement import RaggedShard
from .ragged_layout import flat_interval_boxes

aten = torch.ops.aten

_ORIGINAL: dict[str, Any] = {}


def _has_ragged(placements: Sequence[Placement]) -> bool:
    return any(isinstance(p, RaggedShard) for p in placements)


def _ragged_mesh_dim(spec: DTensorSpec) -> int | None:
    for i, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            return i
    return None


def _check_spec(placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int]) -> None:
    """Validate ragged placements against a mesh and shape; raise before any collective."""
    ragged_dims = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if len(ragged_dims) > 1:
        raise NotImplementedError(
            f"placements {tuple(placements)}: RaggedShard on more than one mesh dim is not supported"
        )
    if not ragged_dims:
        return
    i = ragged_dims[0]
    placement = placements[i]
    placement.check_mesh_dim_size(mesh.size(i), shape)
    _check_composition(placements, mesh, shape, i)
    placement.layout(_other_dims_local_shape(placements, mesh, shape))


def _is_sharding(p: Placement) -> bool:
    """Each rank holds a different part on this mesh dim (so reductions over it are partial)."""
    return isinstance(p, RaggedShard) or p.is_shard()


def _has_other_shards(placements: Sequence[Placement]) -> bool:
    """``Shard`` on a mesh dim (tensor or expert parallel), besides any RaggedShard."""
    return any(p.is_shard() and not isinstance(p, RaggedShard) for p in placements)


def _check_composition(placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int], i: int) -> None:
    """Plain ``Shard``/``Replicate`` on the other mesh dims; a later Shard that splits the
    ragged rows asks for ``StridedRaggedShard`` with its split factor (the layout names its
    order). Uneven Shards are fine: each rank's ragged layout is of its own local shape."""
    ragged = placements[i]
    split_factor = 1
    for j, p in enumerate(placements):
        if j == i or not p.is_shard():
            continue
        if type(p) is not Shard:
            raise NotImplementedError(f"placements {tuple(placements)}: {p!r} next to a RaggedShard is not supported; use Shard or Replicate")
        if j > i and p.dim % len(shape) < len(ragged.dims):
            split_factor *= mesh.size(j)
    strided = getattr(ragged, "split_factor", 1)
    if strided != split_factor:
        fix = (
            f"StridedRaggedShard({ragged.dims}, {ragged.local_units}, split_factor={split_factor})"
            if split_factor > 1 else f"RaggedShard({ragged.dims}, {ragged.local_units})"
        )
        raise ValueError(
            f"placements {tuple(placements)}: the RaggedShard cuts each rank's local tensor of the "
            f"other mesh dims, whose shards split its rows {split_factor} way(s); use {fix}"
        )


def _other_dims_box(placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offsets of this rank's local tensor under the placements other than
    the RaggedShard (torch's own chunking, uneven included): the tensor the RaggedShard cuts."""
    others = [Replicate() if isinstance(p, RaggedShard) else p for p in placements]
    if not any(p.is_shard() for p in others):
        return tuple(shape), (0,) * len(shape)
    local_shape, offsets = _ORIGINAL["compute_local_shape_and_global_offset"](shape, mesh, others)
    return tuple(local_shape), tuple(offsets)


def _other_dims_local_shape(placements: Sequence[Placement], mesh: DeviceMesh, shape: Sequence[int]) -> tuple[int, ...]:
    return _other_dims_box(placements, mesh, shape)[0]


def other_dims_slice(full: torch.Tensor, placements: Sequence[Placement], mesh: DeviceMesh) -> torch.Tensor:
    """This rank's part of ``full`` under the placements other than the RaggedShard (a view)."""
    sizes, offsets = _other_dims_box(placements, mesh, full.shape)
    for d, (size, offset) in enumerate(zip(sizes, offsets)):
        if size != full.shape[d]:
            full = full.narrow(d, offset, size)
    return full


# --------------------------------------------------------------------------------------
# Redistribution
# --------------------------------------------------------------------------------------


def _partial_kind(p: Partial) -> str:
    if isinstance(p, _NormPartial):
        return "norm"
    return p.reduce_op


def _reduce_scatter_into_ragged(local: torch.Tensor, src: Partial, dst: RaggedShard, mesh: DeviceMesh, i: int) -> torch.Tensor:
    layout = dst.layout(local.shape)
    group = mesh.get_group(i)
    if isinstance(src, _NormPartial):
        powered = local**src.norm_type
        return rc.reduce_scatter_ragged(powered, layout, group, "sum") ** (1.0 / src.norm_type)
    return rc.reduce_scatter_ragged(local, layout, group, src.reduce_op)


def _ragged_to_partial(local: torch.Tensor, src: RaggedShard, dst: Partial, shape: torch.Size, mesh: DeviceMesh, i: int) -> torch.Tensor:
    kind = _partial_kind(dst)
    if kind not in ("sum", "avg"):
        raise NotImplementedError(f"redistribute from {src} to {dst} is not supported")
    scale = float(mesh.size(i)) if kind == "avg" else 1.0
    return rc.ragged_to_partial_sum(local, src.layout(shape), mesh.get_local_rank(i), scale)


def _to_full(local: torch.Tensor, src: Placement, shape: torch.Size, mesh: DeviceMesh, i: int) -> torch.Tensor:
    """Any placement on mesh dim ``i`` -> the replicated value on that dim."""
    if isinstance(src, RaggedShard):
        return rc.gather_ragged(local, src.layout(shape), mesh.get_group(i))
    if src.is_shard():
        return rc.gather_shard_dim(local, shape, src.dim, mesh.get_group(i))
    if src.is_partial():
        return src._reduce_value(local, mesh, i)
    return local


def _transform_mesh_dim(local: torch.Tensor, src: Placement, dst: Placement, shape: torch.Size, mesh: DeviceMesh, i: int) -> torch.Tensor:
    """Move ``local`` from ``src`` to ``dst`` on one mesh dim; the other dims are elementwise."""
    if src == dst or mesh.size(i) == 1 and not (isinstance(src, RaggedShard) or isinstance(dst, RaggedShard)):
        return local
    rank = mesh.get_local_rank(i)
    if isinstance(dst, RaggedShard):
        if isinstance(src, RaggedShard):
            return rc.reshard_ragged(local, src.layout(shape), dst.layout(shape), mesh.get_group(i))
        if src.is_partial():
            return _reduce_scatter_into_ragged(local, src, dst, mesh, i)
        full = _to_full(local, src, shape, mesh, i)
        return dst.split_full(full.contiguous(), rank).clone()
    if isinstance(src, RaggedShard):
        if dst.is_partial():
            return _ragged_to_partial(local, src, dst, shape, mesh, i)
        full = _to_full(local, src, shape, mesh, i)
        if dst.is_shard():
            return rc.split_shard_dim(full, dst.dim, rank, mesh.size(i))
        return full
    if dst.is_replicate() and src.is_partial():
        return src._reduce_value(local, mesh, i)
    if dst.is_partial() and src.is_replicate():
        return dst._partition_value(local, mesh, i)
    raise NotImplementedError(f"redistribute from {src} to {dst} alongside a RaggedShard is not supported")


def _redistribute_composed(local: torch.Tensor, current: DTensorSpec, target: DTensorSpec, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Redistribute where a RaggedShard sits next to Shards on other mesh dims.

    The same other-dim placements with another ragged layout: one all-to-all in the ragged
    dim's group. Otherwise in three steps: gather the ragged dim (this rank's local tensor
    of the other dims), let torch move the other dims, cut the target's ragged dim locally.
    """
    shape = current.shape
    i, j = _ragged_mesh_dim(current), _ragged_mesh_dim(target)
    others_same = current.mesh == target.mesh and i == j and all(
        a == b for k, (a, b) in enumerate(zip(current.placements, target.placements)) if k != i
    )
    if others_same:
        inner = _other_dims_local_shape(current.placements, current.mesh, shape)
        src, dst = current.placements[i], target.placements[i]
        return rc.reshard_ragged(local, src.layout(inner), dst.layout(inner), current.mesh.get_group(i))
    if i is not None:
        inner = _other_dims_local_shape(current.placements, current.mesh, shape)
        local = rc.gather_ragged(local, current.placements[i].layout(inner), current.mesh.get_group(i))
        current = _with_placements(current, [Replicate() if k == i else p for k, p in enumerate(current.placements)])
    middle = target if j is None else _with_placements(target, [Replicate() if k == j else p for k, p in enumerate(target.placements)])
    if current.placements != middle.placements or current.mesh != middle.mesh:
        local = _ORIGINAL["redistribute_local_tensor"](local.contiguous(), current, middle, *args, **kwargs)
    if j is not None:
        local = target.placements[j].split_full(local.contiguous(), target.mesh.get_local_rank(j)).clone()
    return local


def _redistribute_ragged(local: torch.Tensor, current: DTensorSpec, target: DTensorSpec, *args: Any, **kwargs: Any) -> torch.Tensor:
    shape = current.shape
    _check_spec(current.placements, current.mesh, shape)
    _check_spec(target.placements, target.mesh, shape)
    if not current.mesh._is_current_rank_part_of_mesh():
        return local
    if _has_other_shards(current.placements) or _has_other_shards(target.placements):
        return _redistribute_composed(local, current, target, *args, **kwargs)
    # Reduce Partial dims first (elementwise on whatever the local tensor is), then move the
    # ragged dim, then create any new Partial dims: every step sees a well-defined value.
    order = sorted(range(current.mesh.ndim), key=lambda i: (not current.placements[i].is_partial(), target.placements[i].is_partial()))
    for i in order:
        local = _transform_mesh_dim(local, current.placements[i], target.placements[i], shape, current.mesh, i)
    return local


def redistribute_local_tensor(local_tensor: torch.Tensor, current_spec: DTensorSpec, target_spec: DTensorSpec, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Drop-in for torch's ``redistribute_local_tensor`` that handles RaggedShard specs."""
    if _has_ragged(current_spec.placements) or _has_ragged(target_spec.placements):
        return _redistribute_ragged(local_tensor, current_spec, target_spec, *args, **kwargs)
    return _ORIGINAL["redistribute_local_tensor"](local_tensor, current_spec, target_spec, *args, **kwargs)


# --------------------------------------------------------------------------------------
# Sharding propagation
# --------------------------------------------------------------------------------------

# Ops that keep the layout of their (same-shaped) tensor operands besides those tagged
# pointwise: copies, casts, fills and the ``*_like`` factories optimizers use for state.
_LAYOUT_PRESERVING = {
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.copy_.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
}
_FULL_REDUCTIONS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum"}


# Fused optimizer kernels are elementwise over lists of same-layout tensors, like _foreach_.
_FUSED_OPTIMIZER_PREFIXES = ("aten::_foreach_", "aten::_fused_adam", "aten::_fused_sgd", "aten::_fused_adagrad")


def _is_layout_preserving(op: torch._ops.OpOverload) -> bool:
    return op in _LAYOUT_PRESERVING or torch.Tag.pointwise in op.tags or (
        op.name().startswith(_FUSED_OPTIMIZER_PREFIXES) and op not in (aten._foreach_norm.Scalar, aten._foreach_max.default)
    )


def _is_scalar_spec(spec: DTensorSpec) -> bool:
    return spec.ndim == 0 and not _has_ragged(spec.placements)


def _spec_like(ref: DTensorSpec, meta: TensorMeta) -> DTensorSpec:
    return DTensorSpec(ref.mesh, ref.placements, tensor_meta=meta)


def _with_placements(spec: DTensorSpec, placements: Sequence[Placement]) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def _positions(schema: OpSchema) -> list[list[DTensorSpec | None]]:
    """Tensor operands grouped by position: one group for an op, one per index for foreach."""
    groups: list[list[DTensorSpec | None]] = []
    for arg in schema.args_schema:
        if isinstance(arg, (list, tuple)) and arg and any(isinstance(a, DTensorSpec) for a in arg):
            for j, a in enumerate(arg):
                if len(groups) <= j:
                    groups.append([])
                groups[j].append(a if isinstance(a, DTensorSpec) else None)
    if groups:
        return groups
    return [[a for a in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema)) if isinstance(a, DTensorSpec)]]


def _layout_preserving_rule(schema: OpSchema, out_meta: Any) -> OutputSharding | None:
    """Pointwise on one ragged layout: compute locally, keep the layout; else ``None``.

    Operands with the same shape but another placement are first redistributed to the ragged
    layout; 0-d replicated operands (scalars, ``step`` tensors) pass through. Broadcasting
    against a non-scalar operand is left to the fallback.
    """
    refs: list[DTensorSpec] = []
    for group in _positions(schema):
        ref = next((s for s in group if s is not None and _has_ragged(s.placements)), None)
        if ref is None:
            ref = next((s for s in group if s is not None and not _is_scalar_spec(s)), None)
        if ref is None:
            return None
        for s in group:
            if s is not None and not _is_scalar_spec(s) and s.shape != ref.shape:
                return None
        refs.append(ref)

    def target(spec: Any, ref: DTensorSpec) -> Any:
        if not isinstance(spec, DTensorSpec) or _is_scalar_spec(spec) or spec.placements == ref.placements:
            return spec
        return _with_placements(spec, ref.placements)

    foreach = len(refs) > 1 or any(isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensorSpec) for a in schema.args_schema)
    if foreach:
        new_args = tuple(
            type(a)(target(x, refs[j]) for j, x in enumerate(a)) if isinstance(a, (list, tuple)) and a and any(isinstance(x, DTensorSpec) for x in a)
            else target(a, refs[0]) for a in schema.args_schema
        )
    else:
        new_args = tuple(target(a, refs[0]) for a in schema.args_schema)
    new_kwargs = {k: target(v, refs[0]) for k, v in schema.kwargs_schema.items()}
    needs = new_args != tuple(schema.args_schema) or new_kwargs != dict(schema.kwargs_schema)
    redistribute_schema = OpSchema(schema.op, new_args, new_kwargs, schema.schema_info) if needs else None

    if out_meta is None:
        output_spec = None
    elif isinstance(out_meta, TensorMeta):
        output_spec = _spec_like(refs[0], out_meta)
    else:
        output_spec = tuple(_spec_like(refs[j if foreach else 0], m) if m is not None else None for j, m in enumerate(out_meta))
    return OutputSharding(output_spec, redistribute_schema=redistribute_schema, needs_redistribute=needs)


def _norm_partial(norm_type: float) -> Placement:
    if norm_type == math.inf:
        return Partial("max")
    if norm_type == -math.inf:
        return Partial("min")
    if norm_type == 0:
        return Partial("sum")
    return _NormPartial(norm_type)


def _full_reduction_rule(schema: OpSchema, out_meta: Any) -> OutputSharding | None:
    """``sum()`` over every dim of a ragged tensor: local sums, ``Partial(sum)``."""
    kind = _FULL_REDUCTIONS.get(schema.op)
    if kind is None or not isinstance(schema.args_schema[0], DTensorSpec):
        return None
    spec = schema.args_schema[0]
    dims = schema.args_schema[1] if len(schema.args_schema) > 1 else schema.kwargs_schema.get("dim")
    if dims not in (None, []) and sorted(d % max(spec.ndim, 1) for d in dims) != list(range(spec.ndim)):
        return None
    if any(p.is_partial() for p in spec.placements):
        return None
    placements = tuple(Partial(kind) if _is_sharding(p) else p for p in spec.placements)
    return OutputSharding(DTensorSpec(spec.mesh, placements, tensor_meta=out_meta))


def _replicate_fallback(propagator: Any, schema: OpSchema) -> OutputSharding:
    """Any other op: gather ragged operands to Replicate, then let torch decide."""
    op = schema.op
    if op._schema.is_mutable and any(
        isinstance(a, DTensorSpec) and _has_ragged(a.placements) for a in pytree.tree_leaves(schema.args_schema[:1])
    ):
        raise NotImplementedError(
            f"{op} modifies a RaggedShard DTensor in place but is not elementwise on its layout; "
            "call .full_tensor() or .redistribute() first"
        )
    if op._schema._is_view_op() and op not in _LAYOUT_PRESERVING:
        raise NotImplementedError(
            f"{op} is a view and cannot alias a RaggedShard DTensor's storage; "
            "call .full_tensor() or .redistribute(placements=[Replicate()]) first"
        )

    def replicate(a: Any) -> Any:
        if isinstance(a, DTensorSpec) and _has_ragged(a.placements):
            return _with_placements(a, [Replicate() if isinstance(p, RaggedShard) else p for p in a.placements])
        return a

    replicated = OpSchema(
        op, pytree.tree_map(replicate, schema.args_schema), pytree.tree_map(replicate, schema.kwargs_schema), schema.schema_info
    )
    result = _ORIGINAL["propagate_non_cached"](propagator, replicated)
    if result.redistribute_schema is None:
        result.redistribute_schema = replicated
    result.needs_redistribute = True
    return result


def _propagate_ragged(propagator: Any, schema: OpSchema) -> OutputSharding:
    for spec in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema)):
        if isinstance(spec, DTensorSpec) and _has_ragged(spec.placements):
            _check_spec(spec.placements, spec.mesh, spec.shape)
    out_meta = propagator._propagate_tensor_meta_non_cached(schema)
    rule = None
    if _is_layout_preserving(schema.op):
        rule = _layout_preserving_rule(schema, out_meta)
    elif schema.op in _FULL_REDUCTIONS:
        rule = _full_reduction_rule(schema, out_meta)
    return rule if rule is not None else _replicate_fallback(propagator, schema)


def _schema_has_ragged(schema: OpSchema | None) -> bool:
    if schema is None:
        return False
    return any(
        isinstance(a, DTensorSpec) and _has_ragged(a.placements)
        for a in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
    )


def _propagate_op_sharding_dispatch_slow_path(self: Any, op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool) -> object:
    if _schema_has_ragged(op_info.schema):
        return _propagate_ragged(self.sharding_propagator, op_info.schema)
    return _ORIGINAL["slow_path"](self, op_call, args, kwargs, op_info, try_cache)


# --------------------------------------------------------------------------------------
# Norms: a rank holding nothing contributes the identity
# --------------------------------------------------------------------------------------


def _local_vector_norm(local: torch.Tensor, ord: float, dtype: torch.dtype | None) -> torch.Tensor:
    if local.numel() == 0:
        identity = math.inf if ord == -math.inf else 0.0
        out_dtype = dtype or (local.dtype if local.is_floating_point() else torch.get_default_dtype())
        return torch.full((), identity, dtype=out_dtype, device=local.device)
    return torch.linalg.vector_norm(local, ord, dtype=dtype)


def _ragged_norm_spec(spec: DTensorSpec, ord: float, out: torch.Tensor) -> DTensorSpec | None:
    if any(p.is_partial() for p in spec.placements):
        return None
    placements = tuple(_norm_partial(ord) if _is_sharding(p) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=TensorMeta(torch.Size(()), (), out.dtype))


def _call_torch_default(op: Any, args: Any, kwargs: Any) -> Any:
    # Our handler is registered for every DTensor; step aside for non-ragged calls.
    handlers = DTensor._op_dispatcher._custom_op_handlers
    ours = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = ours


def _vector_norm_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    if not (isinstance(x, DTensor) and _has_ragged(x.placements)) or dim not in (None, []) or keepdim:
        return _call_torch_default(op, args, kwargs)
    _check_spec(x.placements, x.device_mesh, x.shape)
    out = _local_vector_norm(x._local_tensor, float(ord), dtype)
    spec = _ragged_norm_spec(x._spec, float(ord), out)
    if spec is None:
        return _call_torch_default(op, args, kwargs)
    return DTensor(out, spec, requires_grad=False)


def _foreach_norm_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    tensors = args[0]
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if not any(isinstance(t, DTensor) and _has_ragged(t.placements) for t in tensors):
        return _call_torch_default(op, args, kwargs)
    results = []
    for t in tensors:
        if not (isinstance(t, DTensor) and _has_ragged(t.placements)):
            results.append(_call_torch_default(op, ([t], ord, dtype), {})[0])
            continue
        _check_spec(t.placements, t.device_mesh, t.shape)
        out = _local_vector_norm(t._local_tensor, ord, dtype)
        spec = _ragged_norm_spec(t._spec, ord, out)
        results.append(DTensor(out, spec, requires_grad=False) if spec is not None else torch.linalg.vector_norm(t.full_tensor(), ord, dtype=dtype))
    return results


# --------------------------------------------------------------------------------------
# distribute_tensor / from_local
# --------------------------------------------------------------------------------------


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *, src_data_rank: int | None = 0) -> DTensor:
    """``torch.distributed.tensor.distribute_tensor`` that also accepts RaggedShard placements."""
    if placements is None or not _has_ragged(placements) or isinstance(tensor, DTensor):
        return _ORIGINAL["distribute_tensor"](tensor, device_mesh, placements, src_data_rank=src_data_rank)
    if device_mesh is None:
        raise ValueError("distribute_tensor with a RaggedShard placement needs an explicit device_mesh")
    mesh = device_mesh
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"{len(placements)} placements for a {mesh.ndim}-D mesh; give one per mesh dim")
    _check_spec(placements, mesh, tensor.shape)
    if any(p.is_partial() for p in placements):
        raise ValueError(f"distribute_tensor cannot create Partial placements: {placements}")
    full = tensor.detach().to(mesh.device_type).contiguous()
    if src_data_rank is not None and mesh._is_current_rank_part_of_mesh():
        for i in range(mesh.ndim):
            torch.distributed.broadcast(full, group_src=src_data_rank, group=mesh.get_group(i))
    i = _ragged_mesh_dim(DTensorSpec(mesh, placements))
    local = placements[i].split_full(other_dims_slice(full, placements, mesh).contiguous(), mesh.get_local_rank(i)).clone()
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype))
    return DTensor(local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad)


def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *, run_check: bool = False, shape: torch.Size | None = None, stride: tuple[int, ...] | None = None, **kwargs: Any) -> DTensor:
    """``DTensor.from_local`` that validates RaggedShard placements before building the DTensor."""
    if placements is not None and _has_ragged(placements):
        if shape is None or stride is None:
            raise ValueError(
                f"DTensor.from_local with {tuple(placements)} needs shape= and stride= of the global "
                "tensor: ragged shards differ in size per rank, so the global shape cannot be inferred"
            )
        mesh = device_mesh
        if mesh is None:
            raise ValueError("DTensor.from_local with a RaggedShard placement needs an explicit device_mesh")
        _check_spec(tuple(placements), mesh, shape)
        i = next(j for j, p in enumerate(placements) if isinstance(p, RaggedShard))
        inner = _other_dims_local_shape(placements, mesh, shape)
        expected = placements[i].layout(inner).slices[mesh.get_local_rank(i)].local_shape
        if tuple(local_tensor.shape) != tuple(expected):
            raise ValueError(
                f"DTensor.from_local: local tensor of shape {tuple(local_tensor.shape)} on mesh rank "
                f"{mesh.get_local_rank(i)}, but {placements[i]!r} of global shape {tuple(shape)} puts "
                f"a local tensor of shape {tuple(expected)} there"
            )
    return _ORIGINAL["from_local"](local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride, **kwargs)


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement], skip_offset: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's local-shape-and-offset query, answered for a ragged shard that is one box.

    Row-wise shards (the runtime's) are one box of whole rows; an element-wise shard is
    generally several boxes, which this single-box API cannot describe: refuse rather than lie.
    """
    if not _has_ragged(placements):
        return _ORIGINAL["compute_local_shape_and_global_offset"](global_shape, mesh, placements, skip_offset)
    _check_spec(tuple(placements), mesh, global_shape)
    i = next(j for j, p in enumerate(placements) if isinstance(p, RaggedShard))
    inner, inner_offsets = _other_dims_box(placements, mesh, global_shape)
    rank_slice = placements[i].layout(inner).slices[mesh.get_local_rank(i)]
    boxes = [(_shift(o, inner_offsets), s) for o, s in flat_interval_boxes(inner, rank_slice.offset, rank_slice.length)]
    if len(boxes) > 1:
        raise ValueError(
            f"{placements[i]!r} on shape {tuple(global_shape)}: this rank's shard is {len(boxes)} boxes, "
            "not one; use a row-wise RaggedShard (dims=(0,)) where a single local box is required"
        )
    if not boxes:
        empty = (0, *inner[1:]) if len(global_shape) else (0,)
        return empty, inner_offsets
    offsets, sizes = boxes[0]
    return tuple(sizes), tuple(offsets)


# --------------------------------------------------------------------------------------
# torch.distributed.checkpoint: a ragged shard as a few regular boxes, no communication
# --------------------------------------------------------------------------------------


def _shift(offsets: Sequence[int], by: Sequence[int]) -> tuple[int, ...]:
    return tuple(o + b for o, b in zip(offsets, by))


def _local_boxes(t: DTensor) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(global offsets, sizes, start in the local flat storage) for each box of this rank;
    next to tensor-parallel shards, the boxes of the ragged cut of this rank's TP shard."""
    i = _ragged_mesh_dim(t._spec)
    placement = t.placements[i]
    inner, inner_offsets = _other_dims_box(t.placements, t.device_mesh, t.shape)
    rank_slice = placement.layout(inner).slices[t.device_mesh.get_local_rank(i)]
    boxes, local_start = [], 0
    for offsets, sizes in flat_interval_boxes(inner, rank_slice.offset, rank_slice.length):
        boxes.append((_shift(offsets, inner_offsets), sizes, local_start))
        local_start += math.prod(sizes)
    return boxes


def _create_write_items(self: DTensor, fqn: str, obj: Any) -> list[WriteItem]:
    if not _has_ragged(self.placements):
        return _ORIGINAL["__create_write_items__"](self, fqn, obj)
    properties = TensorProperties.create_from_tensor(self._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=properties,
                size=self.size(),
            ),
        )
        for offsets, sizes, _ in _local_boxes(self)
    ]


def _create_chunk_list(self: DTensor) -> list[ChunkStorageMetadata]:
    if not _has_ragged(self.placements):
        return _ORIGINAL["__create_chunk_list__"](self)
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in _local_boxes(self)]


def _get_tensor_shard(self: DTensor, index: MetadataIndex) -> torch.Tensor:
    if not _has_ragged(self.placements):
        return _ORIGINAL["__get_tensor_shard__"](self, index)
    flat = self._local_tensor.reshape(-1)
    for offsets, sizes, start in _local_boxes(self):
        if torch.Size(offsets) == index.offset:
            return flat[start : start + math.prod(sizes)].view(sizes)
    raise ValueError(f"{index.fqn}: no local ragged chunk at offset {tuple(index.offset)}")


# --------------------------------------------------------------------------------------
# Random in-place initialisers: the same values as on the full tensor
# --------------------------------------------------------------------------------------

_RANDOM_INPLACE = (
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # a Python keyword
    aten.random_.to,
)


# Ops whose CPU draw, made in consecutive pieces, equals one draw of the whole tensor (see
# _draw_local_part_of_full): uniform_ takes one draw per element; normal_ fills 16 elements
# from 16 uniforms, and recomputes the last 16 of a tensor whose size is not a multiple of 16.
_PIECEWISE_ON_CPU = (aten.uniform_.default, aten.normal_.default)
# Elements per piece (a multiple of 16); the temporary is at most twice this (512 KiB in fp32).
_RANDOM_PIECE = 1 << 16


def _random_inplace_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    """Fill a ragged shard with its slice of a full-tensor draw from the default generator.

    Every rank draws as if it drew the whole tensor with the same generator state, so sharded
    ``reset_parameters()`` after meta-device init gives exactly the eager model's values at
    every world size. On CPU, ``uniform_`` and ``normal_`` (what ``reset_parameters`` and
    ``nn.init`` use) draw in pieces of at most ``2 * _RANDOM_PIECE`` elements and keep only
    this rank's slice, so no full-size tensor is ever allocated; other ops, and other devices
    (whose generators draw in a layout that pieces would change), draw the full tensor once.
    """
    target = args[0]
    if not (isinstance(target, DTensor) and _has_ragged(target.placements)):
        return _call_torch_default(op, args, kwargs)
    i = _ragged_mesh_dim(target._spec)
    rank = target.device_mesh.get_local_rank(i)
    local = target._local_tensor
    if op in _PIECEWISE_ON_CPU and local.device.type == "cpu" and target.ndim and len(target.placements) == 1:
        part = target.placements[i].layout(target.shape).slices[rank]
        _draw_local_part_of_full(op, local.view(-1), part.offset, target.numel(), args[1:], kwargs)
        return target
    full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
    op(full, *args[1:], **kwargs)
    local.copy_(target.placements[i].split_full(other_dims_slice(full, target.placements, target.device_mesh).contiguous(), rank))
    return target


def _draw_local_part_of_full(op: Any, out: torch.Tensor, start: int, numel: int, args: tuple, kwargs: dict) -> None:
    """``out`` = elements ``[start, start + out.numel())`` of ``op`` applied to a fresh tensor of
    ``numel`` elements, drawn in pieces (all but the last a multiple of 16 elements; the last
    between one and two pieces long, so a tail recomputation stays inside it)."""
    stop = start + out.numel()
    piece = torch.empty(min(numel, 2 * _RANDOM_PIECE), dtype=out.dtype, device=out.device)
    position = 0
    while position < numel:
        size = _RANDOM_PIECE if numel - position >= 2 * _RANDOM_PIECE else numel - position
        drawn = piece[:size]
        op(drawn, *args, **kwargs)  # also where nothing is kept: the generator must advance alike
        low, high = max(position, start), min(position + size, stop)
        if low < high:
            out[low - start : high - start].copy_(drawn[low - position : high - position])
        position += size


def every_copy_of_mesh(mesh: DeviceMesh) -> torch.Tensor:
    """The ranks of every copy of ``mesh`` in its root, shape ``(copies, *mesh.shape)``: a
    submesh (``root["dp"]``) has one per coordinate of the other dims, and a group built over
    it must be created by every rank of the world, for every copy, in one order."""
    return mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, *mesh.shape)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (submeshes of one root, by name), as FSDP2
    builds its (dp, tp) mesh for tensor-parallel parameters; no collective."""
    return DeviceMesh._concatenate(meshes)


def set_local_tensor(dtensor: DTensor, local: torch.Tensor) -> None:
    """Re-point a DTensor (e.g. a sharded parameter) at new local storage, keeping its identity.

    ``param.data = ...`` does not reach a DTensor's local tensor, so this sets it directly
    (FSDP2 does the same); the layout must not change.
    """
    if local.shape != dtensor._local_tensor.shape:
        raise ValueError(f"new local tensor {tuple(local.shape)} does not match {tuple(dtensor._local_tensor.shape)}")
    dtensor._local_tensor = local


def set_version_counter(tensor: torch.Tensor, version: int) -> None:
    """Reset ``tensor``'s autograd version counter (shared with all its views) to ``version``.

    The all-gather refills the storage that the unsharded parameters (saved for backward)
    alias, with the same values, so autograd must not see it as a modification. gloo's
    asynchronous all-gather writes from its own thread, after the call returns, so the
    version is restored when the collective is waited on. FSDP2 uses the same private API
    (through ``_unsafe_preserve_version_counter``) for its copy-out.
    """
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


def make_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: torch.Size, stride: tuple[int, ...], requires_grad: bool = False) -> DTensor:
    """A DTensor over ``local`` with no autograd edge and no validation (the runtime's hot path)."""
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return _dtensor_at_offset_zero(local, spec, requires_grad)


def _dtensor_at_offset_zero(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """A DTensor over ``local`` whose wrapper has storage offset 0.

    DTensor's wrapper copies its local tensor's storage offset, and torch's ``deepcopy`` and
    pickling recognise a wrapper subclass by ``data_ptr() == 0``: over a view at an offset
    (a slice of a DBuffer, or a ``detach()`` of one, as ``state_dict()`` returns), the
    DTensor is taken for a tensor owning storage and copying or saving it fails. Built over
    an alias of the same storage at offset 0 (no copy), then pointed at the real view.
    """
    if local.storage_offset() == 0:
        return DTensor(local, spec, requires_grad=requires_grad)
    alias = torch.empty(0, dtype=local.dtype, device=local.device).set_(local.untyped_storage(), 0, local.shape, local.stride())
    dtensor = DTensor(alias, spec, requires_grad=requires_grad)
    dtensor._local_tensor = local
    return dtensor


def _offset_free(self: DTensor) -> DTensor:
    twin = _dtensor_at_offset_zero(self._local_tensor, self._spec, self.requires_grad)
    if self.grad is not None:
        twin.grad = self.grad
    return twin


def _dtensor_deepcopy(self: DTensor, memo: dict) -> DTensor:
    """``copy.deepcopy`` of any DTensor, also one whose wrapper has a storage offset."""
    if self.storage_offset() == 0 or id(self) in memo or not self.is_leaf:
        return _ORIGINAL["__deepcopy__"](self, memo)
    twin = _offset_free(self)
    result = _ORIGINAL["__deepcopy__"](twin, memo)
    memo[id(self)] = result
    memo.setdefault(id(memo), []).append(twin)  # as copy._keep_alive: the twin's id stays unique
    return result


def _dtensor_reduce_ex(self: DTensor, protocol: int) -> Any:
    """Pickling (``torch.save``) of any DTensor, also one whose wrapper has a storage offset."""
    if self.storage_offset() == 0:
        return _ORIGINAL["__reduce_ex__"](self, protocol)
    return _ORIGINAL["__reduce_ex__"](_offset_free(self), protocol)


# --------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------


def _redirect(original: types.FunctionType, replacement: Any) -> types.FunctionType:
    """Make ``original`` itself call ``replacement``; return an untouched copy of it.

    torch modules and user code bind these functions by name (``from ... import
    distribute_tensor``), some before ``vescale_plugins`` is imported. Rebinding names would
    miss references taken earlier (locals, partials, other objects), so the function object
    is changed instead: its code becomes a call to ``replacement``, and ``replacement``
    calls the returned copy for what it leaves to torch. Import order no longer matters.
    """
    copy = types.FunctionType(original.__code__, original.__globals__, original.__name__, original.__defaults__, original.__closure__)
    copy.__kwdefaults__ = original.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = original.__qualname__, original.__doc__, original.__module__
    copy.__dict__.update(original.__dict__)
    # The trampoline looks ``replacement`` up in the original's module globals, under a name
    # no torch code uses.
    name = f"_vescale_plugins_{original.__name__}"
    original.__globals__[name] = replacement
    namespace: dict[str, Any] = {}
    exec(f"def trampoline(*args, **kwargs):\n    return {name}(*args, **kwargs)\n", {}, namespace)
    original.__code__ = namespace["trampoline"].__code__
    original.__defaults__ = None
    original.__kwdefaults__ = None
    original.__wrapped__ = copy  # inspect.signature shows the real signature
    return copy


def install() -> None:
    """Install the hooks once; idempotent."""
    if _ORIGINAL:
        return
    dispatcher_cls = dtensor_dispatch.OpDispatcher
    propagator_cls = type(DTensor._op_dispatcher.sharding_propagator)
    _ORIGINAL.update(
        slow_path=dispatcher_cls._propagate_op_sharding_dispatch_slow_path,
        propagate_non_cached=propagator_cls.propagate_op_sharding_non_cached,
        __create_write_items__=DTensor.__create_write_items__,
        __create_chunk_list__=DTensor.__create_chunk_list__,
        __get_tensor_shard__=DTensor.__get_tensor_shard__,
        __deepcopy__=DTensor.__deepcopy__,
        __reduce_ex__=DTensor.__reduce_ex__,
    )
    # Module-level functions (and from_local, a staticmethod) are redirected in place, so
    # references taken before this import reach our code too.
    _ORIGINAL["redistribute_local_tensor"] = _redirect(dtensor_redistribute.redistribute_local_tensor, redistribute_local_tensor)
    _ORIGINAL["distribute_tensor"] = _redirect(dtensor_api.distribute_tensor, distribute_tensor)
    _ORIGINAL["compute_local_shape_and_global_offset"] = _redirect(
        dtensor_utils.compute_local_shape_and_global_offset, compute_local_shape_and_global_offset
    )
    _ORIGINAL["from_local"] = _redirect(DTensor.__dict__["from_local"].__func__, from_local)
    dispatcher_cls._propagate_op_sharding_dispatch_slow_path = _propagate_op_sharding_dispatch_slow_path
    DTensor._op_dispatcher._custom_op_handlers[aten.linalg_vector_norm.default] = _vector_norm_handler
    DTensor._op_dispatcher._custom_op_handlers[aten._foreach_norm.Scalar] = _foreach_norm_handler
    for op in _RANDOM_INPLACE:
        DTensor._op_dispatcher._custom_op_handlers[op] = _random_inplace_handler
    DTensor.__create_write_items__ = _create_write_items
    DTensor.__create_chunk_list__ = _create_chunk_list
    DTensor.__get_tensor_shard__ = _get_tensor_shard
    DTensor.__deepcopy__ = _dtensor_deepcopy
    DTensor.__reduce_ex__ = _dtensor_reduce_ex

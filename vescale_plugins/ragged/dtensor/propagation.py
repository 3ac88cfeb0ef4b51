"""Sharding propagation for ops on ragged operands (OpDispatcher's slow path, private).

A rule runs once per layout on every torch release. The C++ sharding cache keys on our
placement's ``__hash__``/``__eq__``; where it builds no key (``_foreach_*`` ops before torch
2.13) torch calls the slow path with ``try_cache=True`` at every call, and its own answer then
comes from a Python cache: ours is :class:`ShardingCache`, the same rule's answer, per mesh."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch.distributed._functional_collectives import _are_we_tracing
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.utils import _pytree as pytree

from vescale_plugins.ragged.dtensor.cache import ShardingCache
from vescale_plugins.ragged.dtensor.specs import (
    ORIGINAL,
    aten,
    check_spec,
    has_ragged,
    is_sharding,
    spec_like,
    with_placements,
)
from vescale_plugins.ragged.placement import RaggedShard

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
    return (
        op in _LAYOUT_PRESERVING
        or torch.Tag.pointwise in op.tags
        or (
            op.name().startswith(_FUSED_OPTIMIZER_PREFIXES)
            and op not in (aten._foreach_norm.Scalar, aten._foreach_max.default)
        )
    )


def _is_scalar_spec(spec: DTensorSpec) -> bool:
    return spec.ndim == 0 and not has_ragged(spec.placements)


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
        ref = next((s for s in group if s is not None and has_ragged(s.placements)), None)
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
        return with_placements(spec, ref.placements)

    foreach = len(refs) > 1 or any(
        isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensorSpec) for a in schema.args_schema
    )
    if foreach:
        new_args = tuple(
            type(a)(target(x, refs[j]) for j, x in enumerate(a))
            if isinstance(a, (list, tuple)) and a and any(isinstance(x, DTensorSpec) for x in a)
            else target(a, refs[0])
            for a in schema.args_schema
        )
    else:
        new_args = tuple(target(a, refs[0]) for a in schema.args_schema)
    new_kwargs = {k: target(v, refs[0]) for k, v in schema.kwargs_schema.items()}
    needs = new_args != tuple(schema.args_schema) or new_kwargs != dict(schema.kwargs_schema)
    redistribute_schema = OpSchema(schema.op, new_args, new_kwargs, schema.schema_info) if needs else None

    output_spec: DTensorSpec | tuple[DTensorSpec | None, ...] | None
    if out_meta is None:
        output_spec = None
    elif isinstance(out_meta, TensorMeta):
        output_spec = spec_like(refs[0], out_meta)
    else:
        output_spec = tuple(
            spec_like(refs[j if foreach else 0], m) if m is not None else None for j, m in enumerate(out_meta)
        )
    return OutputSharding(output_spec, redistribute_schema=redistribute_schema, needs_redistribute=needs)


def _full_reduction_rule(schema: OpSchema, out_meta: Any) -> OutputSharding | None:
    """``sum()`` over every dim of a ragged tensor: local sums, ``Partial(sum)``."""
    kind = _FULL_REDUCTIONS.get(schema.op)
    if kind is None or not isinstance(schema.args_schema[0], DTensorSpec):
        return None
    spec = schema.args_schema[0]
    # aten.sum's dim is ``int[1]?``: a list of dims or None.
    dims = cast(
        "list[int] | None", schema.args_schema[1] if len(schema.args_schema) > 1 else schema.kwargs_schema.get("dim")
    )
    if dims not in (None, []) and sorted(d % max(spec.ndim, 1) for d in dims) != list(range(spec.ndim)):
        return None
    if any(p.is_partial() for p in spec.placements):
        return None
    placements = tuple(Partial(kind) if is_sharding(p) else p for p in spec.placements)
    return OutputSharding(DTensorSpec(spec.mesh, placements, tensor_meta=out_meta))


def _replicate_fallback(propagator: Any, schema: OpSchema) -> OutputSharding:
    """Any other op: gather ragged operands to Replicate, then let torch decide."""
    op = schema.op
    if op._schema.is_mutable and any(
        isinstance(a, DTensorSpec) and has_ragged(a.placements) for a in pytree.tree_leaves(schema.args_schema[:1])
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
        if isinstance(a, DTensorSpec) and has_ragged(a.placements):
            return with_placements(a, [Replicate() if isinstance(p, RaggedShard) else p for p in a.placements])
        return a

    replicated = OpSchema(
        op,
        pytree.tree_map(replicate, schema.args_schema),
        pytree.tree_map(replicate, schema.kwargs_schema),
        schema.schema_info,
    )
    result = ORIGINAL["propagate_non_cached"](propagator, replicated)
    if result.redistribute_schema is None:
        result.redistribute_schema = replicated
    result.needs_redistribute = True
    return result


def _propagate_ragged(propagator: Any, schema: OpSchema) -> OutputSharding:
    for spec in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema)):
        if isinstance(spec, DTensorSpec) and has_ragged(spec.placements):
            check_spec(spec.placements, spec.mesh, spec.shape)
    out_meta = propagator._propagate_tensor_meta_non_cached(schema)
    rule = None
    if _is_layout_preserving(schema.op):
        rule = _layout_preserving_rule(schema, out_meta)
    elif schema.op in _FULL_REDUCTIONS:
        rule = _full_reduction_rule(schema, out_meta)
    return rule if rule is not None else _replicate_fallback(propagator, schema)


def _first_ragged_spec(schema: OpSchema | None) -> DTensorSpec | None:
    """The first operand spec with a RaggedShard, or ``None``. Operands are specs, or lists of
    them (foreach ops): one flat scan, no pytree, as it runs at every call torch's C++ cache
    cannot answer (every ``_foreach_*`` op before torch 2.13)."""
    if schema is None:
        return None
    for arg in (*schema.args_schema, *schema.kwargs_schema.values()):
        if isinstance(arg, DTensorSpec):
            if has_ragged(arg.placements):
                return arg
        elif isinstance(arg, (list, tuple)):
            for a in arg:
                if isinstance(a, DTensorSpec) and has_ragged(a.placements):
                    return a
    return None


def _identity_view(op_info: Any) -> DTensor | None:
    """``view`` of a ragged tensor to its own shape (``t.view_as(t)``, which pipelining's
    zero-bubble backward takes of every parameter to reach its gradient accumulator): an
    alias of the local tensor with the same layout; ``None`` for any other call.

    Returned as the op's result (as torch's slow path returns a decomposition's), so that
    nothing rank-dependent (the local shape) enters the sharding cache.
    """
    schema = op_info.schema
    if schema.op is not aten.view.default or len(schema.args_schema) != 2:
        return None
    spec, size = schema.args_schema
    if not isinstance(spec, DTensorSpec) or not isinstance(size, (list, tuple)):
        return None
    known = [d for d in size if d != -1]
    if len(known) < len(size) - 1:
        return None
    if len(known) < len(size):
        rest = 1
        for d in known:
            rest *= d
        size = [math.prod(spec.shape) // rest if d == -1 and rest else d for d in size]
    if tuple(size) != tuple(spec.shape):
        return None
    local = op_info.local_args[0]
    return DTensor(local.view(local.shape), spec, requires_grad=False)


def propagate_ragged_cached(propagator: Any, schema: OpSchema, mesh: DeviceMesh) -> OutputSharding:
    """:func:`_propagate_ragged` through ``mesh``'s :class:`ShardingCache` (the first ragged
    operand's mesh)."""
    return ShardingCache.of(mesh).get(("rule", schema), lambda: _propagate_ragged(propagator, schema))


def propagate_op_sharding_dispatch_slow_path(
    self: Any, op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool
) -> object:
    ragged = _first_ragged_spec(op_info.schema)
    if ragged is not None:
        view = _identity_view(op_info)
        if view is not None:
            return view
        # torch asks for a cached answer exactly where its C++ cache has none (no key, not
        # tracing); otherwise the C++ cache keeps what we return.
        if try_cache and not _are_we_tracing():
            return propagate_ragged_cached(self.sharding_propagator, op_info.schema, ragged.mesh)
        return _propagate_ragged(self.sharding_propagator, op_info.schema)
    return ORIGINAL["slow_path"](self, op_call, args, kwargs, op_info, try_cache)

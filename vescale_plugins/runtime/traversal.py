"""Walking a module's inputs and outputs: the tensors that need hooks, casts, and the
``torch.func`` guard for the runtime's own buffer refills."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.utils import _apply_to_tensors
from torch.utils import _pytree as pytree

__all__ = ["cast_floating", "map_grad_tensors", "outside_functorch", "register_on_tensors", "tensors_requiring_grad"]

_NOTHING = contextlib.nullcontext()


def outside_functorch() -> Any:
    """The buffers' in-place refills are the runtime's, not the traced function's: hide them
    from an active ``torch.func`` transform (``jvp``, ``vmap``), as FSDP2 does."""
    return torch._C._DisableFuncTorch() if torch._C._are_functorch_transforms_active() else _NOTHING


def map_grad_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor that requires grad in a module's inputs or outputs:
    pytree containers (tuples, lists, dicts, named tuples, Hugging Face's ``ModelOutput``) and
    dataclasses, which pytree leaves whole (FSDP2 traverses them too).

    (Not ``torch.distributed.utils._apply_to_tensors``: the way it rebuilds containers keeps
    extra tensors alive and raises peak memory.)
    """
    try:
        return _map_plain(tree, fn)
    except _NotPlain:
        pass
    flat, spec = pytree.tree_flatten(tree)
    for i, leaf in enumerate(flat):
        if torch.is_tensor(leaf):
            if leaf.requires_grad:
                flat[i] = fn(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: map_grad_tensors(getattr(leaf, f.name), fn) for f in dataclasses.fields(leaf) if f.init}
            flat[i] = dataclasses.replace(leaf, **fields)
    return pytree.tree_unflatten(flat, spec)


class _NotPlain(Exception):
    pass


_PLAIN_LEAVES = (type(None), bool, int, float, str)


def _map_plain(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """:func:`map_grad_tensors` over plain tensors in (nested) tuples, lists and dicts, as
    pytree would map them (the same containers rebuilt, in pytree's order), without pytree's
    cost: a module's usual inputs and outputs. Raises ``_NotPlain`` on anything else
    (before ``fn`` has run on any tensor, so the caller can start over with pytree)."""
    _check_plain(tree)
    return _map_checked(tree, fn)


# Leaves are handled in the loops without a call (a unit's inputs and outputs are usually a
# flat tuple of tensors: once per unit per step, twice in forward).


def _check_plain(tree: Any) -> None:
    kind = type(tree)
    if kind is tuple or kind is list or kind is dict:
        for item in tree.values() if kind is dict else tree:
            item_kind = type(item)
            if item_kind is not torch.Tensor and item_kind not in _PLAIN_LEAVES:
                _check_plain(item)
    elif kind is not torch.Tensor and kind not in _PLAIN_LEAVES:
        raise _NotPlain


def _map_checked(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    kind = type(tree)
    if kind is torch.Tensor:
        return fn(tree) if tree.requires_grad else tree
    if kind is tuple or kind is list:
        return kind(
            [
                (fn(item) if item.requires_grad else item) if type(item) is torch.Tensor else _map_checked(item, fn)
                for item in tree
            ]
        )
    if kind is dict:
        return {key: _map_checked(value, fn) for key, value in tree.items()}
    return tree


def tensors_requiring_grad(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_grad_tensors(tree, collect)
    return found


def register_on_tensors(output: Any, hook: Callable[[torch.Tensor], None]) -> Any:
    for t in tensors_requiring_grad(output):
        t.register_hook(hook)
    return output


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return _apply_to_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)

"""Saving and loading sharded models, for the adapters and for plain-torch users.

Thin wrappers over ``torch.distributed.checkpoint`` (DCP) and its ``state_dict`` helpers:
a sharded checkpoint is a DCP directory written with no gathering (each rank writes the
boxes of its own ragged shards) and loads at any world size; a full checkpoint is one
``torch.save`` file written by rank 0 that a plain, unsharded model loads.

Sharded saves commit atomically (see :mod:`.commit`): a save that dies part-way
leaves the previous checkpoint loadable and is itself never loaded.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    ValueType,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from vescale_plugins.checkpoint.commit import committed_directory, resolve_committed

__all__ = [
    "save_sharded",
    "write_sharded",
    "load_sharded",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
]

MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"


def save_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a DCP directory: the model's (and optimizer's) shards plus ``extra`` picklable state.

    Collective. Committed atomically: a previous checkpoint at ``path`` is replaced only once
    every rank has written everything.
    """
    with committed_directory(path) as staging:
        write_sharded(staging, model, optimizer, extra)


def write_sharded(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """The DCP files of :func:`save_sharded`, written in place into ``directory`` (no commit)."""
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = get_optimizer_state_dict(model, optimizer)
    state.update(extra or {})
    dcp.save(state, checkpoint_id=str(directory))


def load_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a DCP directory into ``model`` (and ``optimizer``), at any world size.

    ``extra`` gives the other entries to read (their current values are the templates);
    the loaded ``extra`` is returned. Only a committed directory loads (see
    :func:`~vescale_plugins.checkpoint.commit.resolve_committed`).
    """
    path = resolve_committed(path)
    state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(model)}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = get_optimizer_state_dict(model, optimizer)
    state.update(extra or {})
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state[MODEL_KEY])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIMIZER_KEY])
    return {k: v for k, v in state.items() if k not in (MODEL_KEY, OPTIMIZER_KEY)}


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain full tensors on CPU, on rank 0 (empty elsewhere): what an unsharded model loads."""
    # A model's full state dict holds only tensors (torch types it as any state-dict value).
    return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=_FULL))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state as full tensors on CPU, keyed by parameter name, on rank 0."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_model_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load full tensors (e.g. ``torch.load`` of a full checkpoint) into a sharded model.

    Every rank passes the full state dict; each keeps its own shards. Keys that the model's
    own load hooks rename (LitGPT's LoRA model takes a base model's ``lm_head.weight`` as
    ``lm_head.linear.weight``) load too, as FSDP1's full-state-dict load takes them: torch's
    ``set_model_state_dict`` shards only the keys the model's state dict has, so each module
    shards any other full tensor just before it copies it into a parameter of its own.
    """
    # torch takes a dict (invariant in its values) of any state-dict value; tensors are one.
    state = cast("dict[str, ValueType]", state_dict)
    hooks = [
        m.register_load_state_dict_pre_hook(_shard_full_tensors)
        for m in model.modules()
        if any(isinstance(p, DTensor) for p in m.parameters(recurse=False))
    ]
    try:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
    finally:
        for hook in hooks:
            hook.remove()


def _shard_full_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A load pre-hook: full plain tensors bound for ``module``'s sharded parameters become
    their shards (torch's own full-state-dict load distributes them the same way)."""
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and type(value) is torch.Tensor and value.shape == param.shape:
            state_dict[prefix + name] = distribute_tensor(
                value.detach().to(param.device), param.device_mesh, param.placements
            )


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load a full optimizer state dict (as saved by :func:`full_optimizer_state_dict`)."""
    set_optimizer_state_dict(model, optimizer, state_dict, options=StateDictOptions(full_state_dict=True))

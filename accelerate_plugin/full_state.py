"""Loading full (unsharded) state into veScale-FSDP models where Accelerate broadcasts from rank 0.

Accelerate's FSDP2 path loads a full state dict with ``broadcast_from_rank0=True``: rank 0
reads the file and torch's ``_state_dict_utils._distribute_tensors`` slices each rank's part
with ``compute_local_shape_and_global_offset``, which does not know the ``RaggedShard``
placement (it returns the full shape, and the copy fails). Until the core teaches that
function ragged row boxes, these helpers broadcast one full tensor at a time and load it
through ``vescale_plugins.checkpoint`` (``distribute_tensor``, which does know the placement).
Sharded (DCP) checkpoints do not come here: Accelerate's own code handles them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from torch.distributed.tensor import DTensor

from vescale_plugins.checkpoint import load_full_model_state_dict, load_full_optimizer_state_dict

__all__ = ["load_model_from_rank0", "load_optimizer_from_rank0", "load_model_file", "load_optimizer_file"]


def load_model_from_rank0(model: nn.Module, rank0_state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load ``rank0_state`` (full tensors on rank 0, ignored elsewhere) into sharded ``model``.

    One full tensor is alive at a time on the other ranks, so their peak host memory is the
    largest tensor, not the model. Every rank learns which names rank 0 lacks before any
    tensor moves, so a mismatch fails on all ranks alike instead of leaving some waiting.
    """
    names = list(model.state_dict())
    mismatch = [None]
    if dist.get_rank() == 0:
        mismatch = [(sorted(set(names) - rank0_state.keys()), sorted(rank0_state.keys() - set(names)))]
    dist.broadcast_object_list(mismatch, src=0)
    missing, unexpected = mismatch[0]
    if strict and (missing or unexpected):
        raise KeyError(f"full state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for name, current in model.state_dict().items():
        if name in missing:
            continue
        full = _broadcast_full(rank0_state.get(name) if dist.get_rank() == 0 else None, current)
        load_full_model_state_dict(model, {name: full}, strict=False)


def load_optimizer_from_rank0(model: nn.Module, optimizer: torch.optim.Optimizer, rank0_state: dict[str, Any] | None) -> None:
    """Load a full optimizer state dict held by rank 0 (``None`` elsewhere) into every rank's shards."""
    holder = [rank0_state if dist.get_rank() == 0 else None]
    # Optimizer state is small next to the model and nested; one object broadcast is simplest.
    dist.broadcast_object_list(holder, src=0)
    load_full_optimizer_state_dict(model, optimizer, holder[0])


def _broadcast_full(value: torch.Tensor | None, current: torch.Tensor) -> torch.Tensor:
    """Rank 0's full tensor on every rank, shaped and typed like the model's entry ``current``."""
    device = (current.to_local() if isinstance(current, DTensor) else current).device
    if value is None:
        full = torch.empty(current.shape, dtype=current.dtype, device=device)
    else:
        full = value.detach().to(device=device, dtype=current.dtype).contiguous()
    dist.broadcast(full, src=0)
    return full


def load_model_file(accelerator: Any, model: nn.Module, input_dir: str, model_index: int, *, strict: bool) -> None:
    """``load_fsdp_model`` for ``FULL_STATE_DICT``: the file ``save_fsdp_model`` wrote, read on rank 0."""
    name = f"{FSDP_MODEL_NAME}.bin" if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}.bin"
    accelerator.wait_for_everyone()
    state = torch.load(os.path.join(input_dir, name), weights_only=True) if accelerator.is_main_process else {}
    load_model_from_rank0(model, state, strict=strict)
    accelerator.wait_for_everyone()


def load_optimizer_file(accelerator: Any, optimizer: torch.optim.Optimizer, model: nn.Module, input_dir: str, optimizer_index: int) -> None:
    """``load_fsdp_optimizer`` for ``FULL_STATE_DICT``: the file ``save_fsdp_optimizer`` wrote."""
    name = f"{OPTIMIZER_NAME}.bin" if optimizer_index == 0 else f"{OPTIMIZER_NAME}_{optimizer_index}.bin"
    accelerator.wait_for_everyone()
    state = torch.load(os.path.join(input_dir, name), weights_only=True) if accelerator.is_main_process else None
    load_optimizer_from_rank0(model, optimizer, state)
    accelerator.wait_for_everyone()

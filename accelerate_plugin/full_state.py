"""``cpu_ram_efficient_loading``: rank 0's full weights into every rank's shards.

Full-state checkpoints (``load_state`` with ``FULL_STATE_DICT``) go through Accelerate's own
FSDP2 code, which works since the core answers ``compute_local_shape_and_global_offset`` for
ragged row shards. This helper stays for the weights rank 0 loaded before sharding: it checks
the keys on every rank before broadcasting, so a mismatched state dict fails instead of hanging.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from vescale_plugins.checkpoint import load_full_model_state_dict

__all__ = ["load_model_from_rank0"]


def load_model_from_rank0(model: nn.Module, rank0_state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load ``rank0_state`` (full tensors on rank 0, ignored elsewhere) into sharded ``model``.

    One full tensor is alive at a time on the other ranks, so their peak host memory is the
    largest tensor, not the model. Every rank learns which names rank 0 lacks before any
    tensor moves, so a mismatch fails on all ranks alike instead of leaving some waiting.
    """
    names = list(model.state_dict())
    mismatch: list[Any] = [None]  # broadcast_object_list's list of objects
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


def _broadcast_full(value: torch.Tensor | None, current: torch.Tensor) -> torch.Tensor:
    """Rank 0's full tensor on every rank, shaped and typed like the model's entry ``current``."""
    device = (current.to_local() if isinstance(current, DTensor) else current).device
    if value is None:
        full = torch.empty(current.shape, dtype=current.dtype, device=device)
    else:
        full = value.detach().to(device=device, dtype=current.dtype).contiguous()
    dist.broadcast(full, src=0)
    return full

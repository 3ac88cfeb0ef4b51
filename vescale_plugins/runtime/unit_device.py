"""Where a unit lives: the default mesh and the device its states move to, as FSDP2 decides.

FSDP2 builds its default mesh on the process's accelerator (CUDA on a GPU machine, whatever
device the parameters were built on) and moves the unit's CPU parameters and buffers to the
mesh's device before sharding (``_fsdp_init._move_states_to_device``); meta-device tensors
stay for deferred init. The DBuffers are then allocated where the collectives run: a model
built on CPU and sharded with no mesh (Accelerate's route) trains on the GPU, not on CPU
tensors under an NCCL group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_device_from_mesh, _move_states_to_device

__all__ = ["default_mesh", "mesh_device", "move_unit_states", "unit_buffers"]


def default_mesh() -> DeviceMesh:
    """The 1-D mesh over every rank on the accelerator (CPU where there is none), as FSDP2's."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialised process group or an explicit mesh")
    return init_device_mesh(torch._C._get_accelerator().type, (dist.get_world_size(),))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a unit on ``mesh`` keeps its states on: the mesh type's current device."""
    return _get_device_from_mesh(mesh)


def unit_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The buffers of the modules a unit manages: those not inside another unit (FSDP2's
    managed modules stop at a nested ``fully_shard`` module)."""
    found: dict[int, torch.Tensor] = {}

    def visit(module: nn.Module) -> None:
        for buffer in module.buffers(recurse=False):
            found.setdefault(id(buffer), buffer)
        for child in module.children():
            if vars(child).get("_vescale_fsdp_unit") is None:
                visit(child)

    for module in modules:
        visit(module)
    return list(found.values())


def move_unit_states(modules: list[nn.Module], params: list[nn.Parameter], device: torch.device) -> None:
    """Move the unit's parameters and buffers to ``device`` with FSDP2's own function (same
    tensors, new data; meta tensors stay). DTensor parameters are already there (set-up
    checked it)."""
    _move_states_to_device(params, unit_buffers(modules), device)

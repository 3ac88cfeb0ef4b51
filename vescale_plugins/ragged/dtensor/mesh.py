"""Mesh helpers that need DeviceMesh internals (``_layout``, ``_rank_map``, ``_concatenate``)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh


def every_copy_of_mesh(mesh: DeviceMesh) -> torch.Tensor:
    """The ranks of every copy of ``mesh`` in its root, shape ``(copies, *mesh.shape)``: a
    submesh (``root["dp"]``) has one per coordinate of the other dims, and a group built over
    it must be created by every rank of the world, for every copy, in one order."""
    return mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, *mesh.shape)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (submeshes of one root, by name), as FSDP2
    builds its (dp, tp) mesh for tensor-parallel parameters; no collective."""
    return DeviceMesh._concatenate(meshes)

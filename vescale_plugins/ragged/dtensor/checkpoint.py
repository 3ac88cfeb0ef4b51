"""torch.distributed.checkpoint's checkpointable protocol for ragged shards: each rank's
shard is described as a few regular boxes, so saving needs no communication."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from vescale_plugins.ragged.dtensor.specs import (
    ORIGINAL,
    has_ragged,
    other_dims_box,
    ragged_placement,
    shift_offsets,
)
from vescale_plugins.ragged.layout import flat_interval_boxes


def _local_boxes(t: DTensor) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(global offsets, sizes, start in the local flat storage) for each box of this rank;
    next to tensor-parallel shards, the boxes of the ragged cut of this rank's TP shard."""
    i, placement = ragged_placement(t.placements)
    inner, inner_offsets = other_dims_box(t.placements, t.device_mesh, t.shape)
    rank_slice = placement.layout(inner).slices[t.device_mesh.get_local_rank(i)]
    boxes, local_start = [], 0
    for offsets, sizes in flat_interval_boxes(inner, rank_slice.offset, rank_slice.length):
        boxes.append((shift_offsets(offsets, inner_offsets), sizes, local_start))
        local_start += math.prod(sizes)
    return boxes


def create_write_items(self: DTensor, fqn: str, obj: Any) -> list[WriteItem]:
    if not has_ragged(self.placements):
        return ORIGINAL["__create_write_items__"](self, fqn, obj)
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


def create_chunk_list(self: DTensor) -> list[ChunkStorageMetadata]:
    if not has_ragged(self.placements):
        return ORIGINAL["__create_chunk_list__"](self)
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in _local_boxes(self)]


def get_tensor_shard(self: DTensor, index: MetadataIndex) -> torch.Tensor:
    if not has_ragged(self.placements):
        return ORIGINAL["__get_tensor_shard__"](self, index)
    flat = self._local_tensor.reshape(-1)
    for offsets, sizes, start in _local_boxes(self):
        if torch.Size(offsets) == index.offset:
            return flat[start : start + math.prod(sizes)].view(sizes)
    assert index.offset is not None  # DCP looks a shard up by the offset of its chunk
    raise ValueError(f"{index.fqn}: no local ragged chunk at offset {tuple(index.offset)}")

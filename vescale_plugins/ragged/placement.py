"""RaggedShard: a DTensor placement where each rank holds a contiguous run of whole blocks.

``RaggedShard(dims, local_units)`` flattens the leading ``dims`` of a tensor into rows and
cuts its row-major storage into ``sum(local_units)`` equal blocks; rank ``r`` of the mesh dim
holds blocks ``[sum(u[:r]), sum(u[:r+1]))`` (``local_units`` keeps the veScale paper's name:
each rank's count of blocks). Zeros are allowed (that rank holds nothing), so one placement
covers element-wise, row-wise (even = ``Shard(0)``, or uneven), block-wise (a block of g
rows) and whole-tensor-on-one-rank (``dims=()``, one-hot counts) sharding.

Stock DTensor code works on it: building the first one teaches torch's DTensor about it (see
:mod:`vescale_plugins.ragged.dtensor` for the few places, and when).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import Placement

from vescale_plugins.ragged.layout import (
    RaggedLayout,
    _validate_placement_args,
    ragged_layout,
)
from vescale_plugins.ragged.units import UnitRuns

__all__ = ["RaggedShard", "StridedRaggedShard"]


# Every ragged DTensor starts from a placement (pickles and checkpoints rebuild it through
# __reduce__), so DTensor is patched at the first one, not at import: the DTensor integration
# (vescale_plugins.ragged.dtensor, which imports this module, and which the package imports)
# registers its idempotent install() here, and this module imports nothing of it.
_AT_EVERY_PLACEMENT: list[Callable[[], None]] = []


def at_every_placement(hook: Callable[[], None]) -> None:
    """Run ``hook`` (idempotent and cheap after its first call) whenever a placement is built."""
    _AT_EVERY_PLACEMENT.append(hook)


def _teach_dtensor() -> None:
    for hook in _AT_EVERY_PLACEMENT:
        hook()


class RaggedShard(Placement):
    """Contiguous, possibly uneven, runs of whole blocks of a tensor per rank.

    Args:
        dims: the prefix ``(0, ..., k-1)`` of tensor dims flattened into rows; the trailing
            dims are never split. ``()`` makes the whole tensor one row.
        local_units: each rank's count of blocks, one non-negative int per rank of the mesh
            dim (their sum > 0: the tensor is cut into that many equal blocks).
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]) -> None:
        super().__init__()
        _teach_dtensor()
        dims, blocks = tuple(int(d) for d in dims), UnitRuns.of(local_units)
        _validate_placement_args(dims, blocks, lambda: f"RaggedShard(dims={dims}, local_units={blocks})")
        self.dims = dims
        # As runs: the same few pairs at any world size (hashed on every DTensor op).
        self.local_units = blocks

    def layout(self, shape: Sequence[int]) -> RaggedLayout:
        """Every rank's slice of a tensor of ``shape`` (raises ``ValueError`` if it does not fit)."""
        return ragged_layout(shape, self.dims, self.local_units)

    def check_mesh_dim_size(self, mesh_dim_size: int, shape: Sequence[int]) -> None:
        """Raise ``ValueError`` unless there is one block count per rank of the mesh dim."""
        if len(self.local_units) != mesh_dim_size:
            raise ValueError(
                f"{self!r} on shape {tuple(shape)}: {len(self.local_units)} local_units for a mesh "
                f"dim of {mesh_dim_size} ranks; give exactly one weight per rank"
            )

    def split_full(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's local tensor, a view of the contiguous ``full`` tensor."""
        rank_slice = self.layout(full.shape).slices[rank]
        flat = full.reshape(-1)
        return flat[rank_slice.offset : rank_slice.offset + rank_slice.length].view(rank_slice.local_shape)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self.dims, self.local_units) == (other.dims, other.local_units)

    def __hash__(self) -> int:
        return hash((RaggedShard, self.dims, self.local_units))

    def __reduce__(self) -> tuple:
        # The C++ base has no pickle support; rebuild from the arguments (torch.save of a
        # state dict with DTensors, copy.deepcopy of a placement or a DTensor spec).
        return (RaggedShard, (self.dims, self.local_units))

    def __deepcopy__(self, memo: dict) -> RaggedShard:
        return RaggedShard(self.dims, self.local_units)

    def __copy__(self) -> RaggedShard:
        return RaggedShard(self.dims, self.local_units)

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS{self.dims}{self._blocks_str()}"

    def _blocks_str(self) -> str:
        return str(list(self.local_units)) if len(self.local_units) <= 64 else repr(self.local_units)


class StridedRaggedShard(RaggedShard):
    """A RaggedShard applied after ``split_factor`` shards of its rows by later mesh dims.

    On a ``(dp, tp)`` mesh whose tensor-parallel dim holds ``Shard(0)`` (ColwiseParallel,
    expert parallelism), veScale-FSDP cuts each rank's tensor-parallel shard, not the global
    tensor: read left to right, as DTensor reads placements, the data-parallel rank's rows
    are strided (a run of rows in each of the ``split_factor`` tensor-parallel chunks). This
    is the paper's StridedRaggedShard and plays the role of FSDP2's ``_StridedShard``. The
    layout arithmetic is RaggedShard's, on the tensor-parallel local shape.
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int], split_factor: int) -> None:
        super().__init__(dims, local_units)
        if isinstance(split_factor, bool) or not isinstance(split_factor, int) or split_factor < 2:
            raise ValueError(f"StridedRaggedShard split_factor must be an int >= 2, got {split_factor!r}")
        self.split_factor = split_factor

    def __eq__(self, other: object) -> bool:
        # super() already requires type(other) is type(self); the isinstance narrows it for mypy.
        return (
            isinstance(other, StridedRaggedShard) and super().__eq__(other) and self.split_factor == other.split_factor
        )

    def __hash__(self) -> int:
        return hash((StridedRaggedShard, self.dims, self.local_units, self.split_factor))

    def __reduce__(self) -> tuple:
        return (StridedRaggedShard, (self.dims, self.local_units, self.split_factor))

    def __deepcopy__(self, memo: dict) -> StridedRaggedShard:
        return StridedRaggedShard(self.dims, self.local_units, self.split_factor)

    def __copy__(self) -> StridedRaggedShard:
        return StridedRaggedShard(self.dims, self.local_units, self.split_factor)

    def __repr__(self) -> str:
        return f"StridedRaggedShard(dims={self.dims}, local_units={self.local_units}, split_factor={self.split_factor})"

    def __str__(self) -> str:
        return f"SRS{self.dims}{self._blocks_str()}/{self.split_factor}"

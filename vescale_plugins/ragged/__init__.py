"""RaggedShard: a DTensor placement where each rank holds a contiguous, possibly uneven run
of whole blocks of a tensor.

* :mod:`.placement`: ``RaggedShard`` and ``StridedRaggedShard`` (the placement objects).
* :mod:`.layout`: the pure arithmetic of a layout (who owns which elements, in what shape).
* :mod:`.collectives`: the collectives that move ragged shards (public torch.distributed only).
* :mod:`.dtensor`: where torch's DTensor is taught about the placement (``install()``).
"""

# Registers the DTensor integration's install() with the placement (it patches nothing yet:
# the first RaggedShard built does), so no placement is ever built before it is registered.
from vescale_plugins.ragged import dtensor as _dtensor  # noqa: F401
from vescale_plugins.ragged.layout import RaggedLayout, RankSlice, flat_interval_boxes, ragged_layout, validate_ragged
from vescale_plugins.ragged.placement import RaggedShard, StridedRaggedShard

__all__ = [
    "RaggedShard",
    "StridedRaggedShard",
    "RaggedLayout",
    "RankSlice",
    "ragged_layout",
    "validate_ragged",
    "flat_interval_boxes",
]

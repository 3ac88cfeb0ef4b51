"""veScale-FSDP core: RaggedShard placement, structure-aware planner, DBuffer runtime.

Importing this package teaches torch's DTensor the ``RaggedShard`` placement (see
``_dtensor_bridge``); nothing else in torch changes behaviour.
"""

from . import _dtensor_bridge
from .fully_shard import UnshardHandle, VeScaleFSDPModule, fully_shard, register_fsdp_forward_method
from .placement import RaggedShard
from .ragged_layout import RaggedLayout, RankSlice, flat_interval_boxes, ragged_layout, validate_ragged

_dtensor_bridge.install()

__all__ = [
    "fully_shard",
    "register_fsdp_forward_method",
    "VeScaleFSDPModule",
    "UnshardHandle",
    "RaggedShard", "RaggedLayout", "RankSlice", "ragged_layout", "validate_ragged", "flat_interval_boxes"]

"""veScale-FSDP: a drop-in for PyTorch FSDP2 over RaggedShard placements, a structure-aware
planner and persistent flat buffers (DBuffer).

Layers, each importing only the ones below it: ``ragged`` and ``planner``; ``dbuffer``;
``runtime`` (``fully_shard``); ``checkpoint``, ``observe``, ``optim``, ``wrap``; the adapters
(``lightning_strategy``, ``accelerate_plugin``); the tools (``bench``, ``forecast``,
``tools``). See ``docs/design.md``.

Importing this package teaches torch's DTensor the ``RaggedShard`` placement
(:func:`vescale_plugins.ragged.dtensor.install`); nothing else in torch changes behaviour.
"""

from vescale_plugins import ragged as _ragged
from vescale_plugins.dbuffer.planning import BufferSplitCost
from vescale_plugins.ragged import *  # noqa: F403  (the placement and layout names, as ragged.__all__ lists them)
from vescale_plugins.runtime.api import fully_shard, register_fsdp_forward_method, share_comm_ctx
from vescale_plugins.runtime.module import GradientReductionHandle, UnshardHandle, VeScaleFSDPModule
from vescale_plugins.runtime.setup import BlockSizeFn, PlanMismatchError

__all__ = [
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "VeScaleFSDPModule",
    "UnshardHandle",
    "GradientReductionHandle",
    "BlockSizeFn",
    "BufferSplitCost",
    "PlanMismatchError",
    *_ragged.__all__,
]

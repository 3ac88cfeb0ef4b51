"""veScale-FSDP: a drop-in for PyTorch FSDP2 over RaggedShard placements, a structure-aware
planner and persistent flat buffers (DBuffer).

Layers, each importing only the ones below it: ``ragged`` and ``planner``; ``dbuffer``;
``runtime`` (``fully_shard``); ``checkpoint``, ``observe``, ``optim``, ``wrap``; the adapters
(``lightning_strategy``, ``accelerate_plugin``); the tools (``bench``, ``forecast``,
``tools``). See ``docs/design.md``.

Importing this package (or ``lightning_strategy``, ``accelerate_plugin``) changes nothing in
torch. The first ``RaggedShard`` built, or the first ``fully_shard`` call, installs once per
process: in DTensor, the code of four functions (``distribute_tensor``, ``DTensor.from_local``,
``_redistribute.redistribute_local_tensor``, ``_utils.compute_local_shape_and_global_offset``),
the op dispatcher's sharding slow path, custom op handlers for p-norms and random in-place
initialisers, and five ``DTensor`` methods (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, ``__deepcopy__``, ``__reduce_ex__``);
and ``fully_shard`` adds one global module parameter-registration hook. Each hands anything
without a RaggedShard, or outside a sharded unit, to torch unchanged
(:mod:`vescale_plugins.ragged.dtensor`, :mod:`vescale_plugins.runtime.registry`).
"""

from vescale_plugins import ragged as _ragged
from vescale_plugins.dbuffer.faults import CollectiveError
from vescale_plugins.dbuffer.planning import BufferSplitCost
from vescale_plugins.ragged import *  # noqa: F403  (the placement and layout names, as ragged.__all__ lists them)
from vescale_plugins.runtime.api import fully_shard, register_fsdp_forward_method, share_comm_ctx
from vescale_plugins.runtime.comm_policy import QuantizedComm
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
    "QuantizedComm",
    "PlanMismatchError",
    "CollectiveError",
    *_ragged.__all__,
]

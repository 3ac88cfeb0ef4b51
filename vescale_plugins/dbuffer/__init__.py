"""DBuffer: persistent flat buffers laid out by the planner, and their in-place collectives.

* :mod:`.buffer`: ``DBuffer`` (one group of a unit's parameters: sharded, unsharded and
  gradient buffers, and the views every parameter and gradient is).
* :mod:`.collectives`: all-gather and reduce-scatter into the caller's buffers (NCCL's tensor
  collectives; point-to-point on gloo, whose own collectives stage full copies).
* :mod:`.streams`: the side streams collectives run on (CUDA).
"""

from vescale_plugins.dbuffer.buffer import DBuffer

__all__ = ["DBuffer"]

"""DBuffer: persistent flat buffers laid out by the planner, and their in-place collectives.

* :mod:`.planning`: the one place DBuffers get their layouts (what the planner is asked, how
  many buffers a group is split into), and the 16-byte alignment.
* :mod:`.buffer`: ``DBuffer`` (one group of a unit's parameters: sharded, unsharded and
  gradient buffers, and the views every parameter and gradient is).
* :mod:`.storage`: flat buffers whose memory comes and goes while their views stay.
* :mod:`.handles`: issued collectives; ``wait()`` completes one and makes its result usable.
* :mod:`.collectives`: all-gather and reduce-scatter into the caller's buffers (NCCL's tensor
  collectives; point-to-point on gloo, whose own collectives stage full copies).
* :mod:`.reduction`: how a gradient buffer's reduction scales its sum (FSDP2's arithmetic).
* :mod:`.input_buffers`: all-gather input buffers for FSDP2's tensor-subclass extensions.
* :mod:`.streams`: the side streams collectives run on (CUDA).
* :mod:`.observer`: the profiler regions around the buffers' work, and one observer hook.
"""

from vescale_plugins.dbuffer.buffer import DBuffer

__all__ = ["DBuffer"]

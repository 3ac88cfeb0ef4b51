"""DBuffer: persistent flat buffers laid out by the planner, and their in-place collectives.

Top down (every call goes down; ``pyproject.toml``'s layer contract keeps it so):

* :mod:`.input_buffers`: the all-gather inputs of FSDP2's tensor-subclass extensions, laid
  out after a DBuffer's rows.
* :mod:`.buffer`: ``DBuffer``, one group of a unit's parameters: sharded, unsharded and
  gradient buffers, the views every parameter and gradient is, and their collectives.
* :mod:`.handles`: an issued all-gather or reduce-scatter; ``wait()`` makes its result
  usable. A reduce-scatter's handle lands its output through the callbacks the DBuffer gives
  it (:class:`~.handles.GradientLanding`), never by calling the DBuffer.
* :mod:`.collectives` (in-place all-gather and reduce-scatter: NCCL's tensor collectives,
  point-to-point on gloo), :mod:`.faults` (a failed collective's error naming its unit, and
  the process groups it broke), :mod:`.planning` (the planner's layouts for a unit's buffers, the 16-byte alignment),
  :mod:`.reduction` (how a gradient sum is scaled, as FSDP2), :mod:`.storage` (flat tensors
  whose memory comes and goes), :mod:`.streams` (the side streams collectives run on).
* :mod:`.observer`: what the run record is told (collectives, buffers).
"""

from vescale_plugins.dbuffer.buffer import DBuffer

__all__ = ["DBuffer"]

"""The side streams collectives run on, on CUDA: one for all-gathers, one for reduce-scatters,
one for what follows a reduce-scatter (HSDP's all-reduce, the all-reduce hook).

A collective is issued on its stream after that stream has waited for the compute stream (so
it sees every write enqueued before it: the optimizer's update of the shards, autograd's
gradients), and an event recorded after it is what the compute stream waits on before using
the result. No ``record_stream``: each buffer's memory belongs to the stream that allocates
it, and is only handed out again to work ordered after every earlier use:

* unsharded parameters are allocated on the all-gather stream; they are freed after the
  compute stream's last read was enqueued, and the next all-gather first waits for the
  compute stream;
* the unsharded gradient buffer is allocated on the compute stream and freed only after the
  compute stream has waited for its reduce-scatter;
* sharded gradients and mixed-precision casts made on a side stream are only reused by later
  work on that same stream, which waits for the compute stream first;
* what the all-reduce stream reads (the reduce output, HSDP's kept-back sums) stays referenced
  until the compute stream has waited for it, at the end of backward.

Elsewhere (CPU, gloo) there is one stream; collectives run asynchronously on the backend's
threads and their ``Work`` objects are waited on instead, and this class does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CommStreams", "comm_streams_for"]

_NOTHING = contextlib.nullcontext()

# Collectives go first when the GPU has both kinds of work ready (FSDP2 does the same).
_HIGH_PRIORITY = -1


class CommStreams:
    """The all-gather, reduce-scatter and all-reduce streams of one device, or nothing off CUDA.

    Args:
        device: the device the buffers live on.
        module: the device's stream API (``torch.cuda``); None disables the streams. Tests
            pass a stand-in to run this path on CPU.
    """

    def __init__(self, device: torch.device, module: Any = None) -> None:
        self.module, self.device = module, device
        self.enabled = module is not None
        self.all_gather: Any = module.Stream(device=device, priority=_HIGH_PRIORITY) if self.enabled else None
        self.reduce_scatter: Any = module.Stream(device=device, priority=_HIGH_PRIORITY) if self.enabled else None
        # HSDP's all-reduce and the all-reduce hook: overlapping the other collectives (they
        # use other links in the usual intra-node shard / inter-node replicate layout), at
        # normal priority, as FSDP2's all-reduce stream.
        self.all_reduce: Any = module.Stream(device=device) if self.enabled else None
        self._post_optim_event: Any = None

    def wait_before_next_all_gather(self, event: Any) -> None:
        """FSDP2's ``set_post_optim_event``: the next all-gather waits for ``event`` (recorded
        after the optimizer step) instead of for all the compute stream's work so far. Off
        CUDA work is already done when the host records an event, so nothing is kept."""
        if self.enabled:
            self._post_optim_event = event

    def issue_on(self, stream: Any, after: Any = None) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current for the block, after it waits for the compute stream (or
        only for the event ``after``: the work it follows on another side stream). Nothing
        off CUDA (a shared no-op context: no generator per collective)."""
        return self._issue_on(stream, after) if self.enabled else _NOTHING

    @contextlib.contextmanager
    def _issue_on(self, stream: Any, after: Any) -> Iterator[None]:
        if after is not None:
            stream.wait_event(after)
        elif stream is self.all_gather and self._post_optim_event is not None:
            stream.wait_event(self._post_optim_event)
            self._post_optim_event = None
        else:
            stream.wait_stream(self.module.current_stream(self.device))
        with self.module.stream(stream):
            yield

    def record(self, stream: Any) -> Any:
        """An event after the work issued so far on ``stream`` (None when disabled)."""
        return stream.record_event() if self.enabled else None

    def wait(self, event: Any) -> None:
        """Make the compute (current) stream wait for ``event``."""
        if event is not None:
            self.module.current_stream(self.device).wait_event(event)


_STREAMS: dict[torch.device, CommStreams] = {}


def comm_streams_for(device: torch.device) -> CommStreams:
    """The process's streams for ``device`` (shared by every unit, as FSDP2 shares its own)."""
    if device not in _STREAMS:
        _STREAMS[device] = CommStreams(device, torch.cuda if device.type == "cuda" else None)
    return _STREAMS[device]

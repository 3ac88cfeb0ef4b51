"""Issued collectives of a DBuffer: ``wait()`` completes one and makes its result usable.

On CUDA the collective ran on a side stream and the handle makes the compute stream wait on
its event; on gloo the handle waits on the backend's ``Work``. Either way the observer (the
run record) learns how long the caller waited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vescale_plugins.dbuffer import observer
from vescale_plugins.dbuffer.observer import REDUCE_SCATTER_REGION
from vescale_plugins.dbuffer.storage import set_version_counter
from vescale_plugins.dbuffer.streams import CommStreams

if TYPE_CHECKING:
    from vescale_plugins.dbuffer.buffer import DBuffer

__all__ = ["GatherHandle", "ReduceScatterHandle", "wait_collective"]


def wait_collective(work: Any) -> None:
    """Complete an issued collective (gloo finishes some of its work here, on this thread:
    the point-to-point reduce-scatter's sums)."""
    work.wait()


def _wait_started(token: Any, work: Any) -> float:
    """When the caller started waiting: now, or (a synchronous collective, no work to wait
    on) when it was issued, since the caller waited throughout."""
    watcher = observer.current()
    if token is None or watcher is None:
        return 0.0
    return watcher.now() if work is not None else token.start_s


def _report_done(token: Any, wait_started: float) -> None:
    watcher = observer.current()
    if token is not None and watcher is not None:
        watcher.collective_done(token, wait_started)


class GatherHandle:
    """An issued all-gather: ``wait()`` completes it and hides the refill from autograd."""

    def __init__(
        self, unsharded: torch.Tensor, version: int, work: Any, token: Any, streams: CommStreams, done: Any
    ) -> None:
        self._unsharded, self._version, self._work, self._token = unsharded, version, work, token
        self._streams, self._done = streams, done
        self.after_wait: Callable[[], None] | None = None

    def wait(self) -> None:
        wait_started = _wait_started(self._token, self._work)
        if self._work is not None:
            wait_collective(self._work)
            self._work = None
        if self._done is not None:
            self._streams.wait(self._done)
            self._done = None
        set_version_counter(self._unsharded, self._version)
        _report_done(self._token, wait_started)
        self._token = None
        if self.after_wait is not None:
            after_wait, self.after_wait = self.after_wait, None
            after_wait()


class ReduceScatterHandle:
    """An issued reduce-scatter: ``wait()`` completes it, all-reduces across replicas (HSDP),
    divides once, lands the result in the sharded gradients and frees the full gradients.

    ``replicate_group``: HSDP's replicas, all-reduced after the reduce-scatter. ``partial``:
    HSDP without the all-reduce this backward; the shard group's sum is kept back.
    """

    def __init__(
        self,
        dbuffer: DBuffer,
        work: Any,
        out: torch.Tensor,
        sharded_grad: torch.Tensor,
        divide_factor: float,
        accumulate: bool,
        in_place: bool,
        token: Any,
        temp_bytes: int,
        done_event: Any,
        replicate_group: dist.ProcessGroup | None,
        partial: bool,
    ) -> None:
        self._dbuffer, self._work, self._sharded_grad = dbuffer, work, sharded_grad
        self._out: torch.Tensor | None = out  # dropped once done
        self._divide_factor, self._accumulate, self._in_place = divide_factor, accumulate, in_place
        self._token, self._temp_bytes, self._done_event = token, temp_bytes, done_event
        self._replicate_group, self._partial = replicate_group, partial
        self.done = False
        # Run once the sharded gradients are final (post-accumulate-grad hooks).
        self.after_wait: Callable[[], None] | None = None

    def wait(self) -> None:
        if self.done:
            return
        assert self._out is not None
        wait_started = _wait_started(self._token, self._work)
        with torch.profiler.record_function(REDUCE_SCATTER_REGION):
            if self._work is not None:
                wait_collective(self._work)
            # The compute stream waits before it reads the result or frees the input.
            self._dbuffer.streams.wait(self._done_event)
            _report_done(self._token, wait_started)
            if self._partial:
                self._dbuffer.keep_partial(self._out)
            else:
                self._finish_gradients(self._out, self._sharded_grad)
            watcher = observer.current()
            if watcher is not None:
                watcher.buffer_freed("comm_buffers", self._temp_bytes)
        # Keep the sharded gradient buffer: it is held weakly by the DBuffer, so this handle is
        # what keeps it alive until the caller has made the gradients' views of it.
        self._out = None
        self._dbuffer.release_unsharded_grad()
        self.done = True
        if self.after_wait is not None:
            after_wait, self.after_wait = self.after_wait, None
            after_wait()

    def _finish_gradients(self, out: torch.Tensor, sharded_grad: torch.Tensor) -> None:
        if self._replicate_group is not None:
            self._dbuffer.add_partial(out)
            dist.all_reduce(out, group=self._replicate_group)
        if self._divide_factor != 1:
            out.div_(self._divide_factor)
        if self._accumulate:
            # CPU offload: the host adds what it has fully received (as FSDP2, a blocking copy).
            out = out.to(sharded_grad.device)
            shard_size = self._dbuffer.shard_size
            sharded_grad[:shard_size].add_(out[:shard_size])
            sharded_grad[shard_size:].copy_(out[shard_size:])  # this reduce's presence flags
        elif not self._in_place:
            self._dbuffer.land_reduced(out, sharded_grad)

"""How the buffers can be watched: the profiler regions around their work, and one observer
(the run record) told of every buffer allocation and collective while it is open.

Off, observation costs one module-level lookup per allocation or collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = [
    "ALL_GATHER_REGION",
    "COMM_BUFFER_REGION",
    "GRADIENT_BUFFER_REGION",
    "GRADIENT_RELEASE_REGION",
    "REDUCE_SCATTER_REGION",
    "BufferObserver",
    "current",
    "observed_by",
    "scope",
]

# Profiler record-function names around the library's collective paths (tests count the
# copies inside them; the run record times them).
ALL_GATHER_REGION = "vescale::all_gather"
REDUCE_SCATTER_REGION = "vescale::reduce_scatter"
# Marked only while observed, so the run record's memory split can tell the buffers apart.
GRADIENT_BUFFER_REGION = "vescale::gradient_buffer"
# Where autograd's gradients are copied into the buffer and freed (the record counts them as
# unsharded gradients by where they die: they are born in whichever op computed them).
GRADIENT_RELEASE_REGION = "vescale::gradient_release"
COMM_BUFFER_REGION = "vescale::comm_buffer"


class BufferObserver(Protocol):
    """What the buffers report. ``kind`` is ``"unsharded_params"``, ``"unsharded_grads"`` or
    ``"comm_buffers"``; sizes are bytes; times are marks of the observer's own clock
    (``now()``: host seconds, or an event on the current CUDA stream)."""

    def now(self) -> Any: ...

    def buffer_allocated(self, kind: str, nbytes: int) -> None: ...

    def buffer_freed(self, kind: str, nbytes: int) -> None: ...

    def collective_issued(self, kind: str, unit: str, nbytes: int, dtype: torch.dtype) -> Any:
        """Called on the stream the collective runs on, before it is launched; returns a token
        for :meth:`collective_enqueued` and :meth:`collective_done`."""

    def collective_enqueued(self, token: Any) -> None:
        """Called on the same stream right after the launch."""

    def collective_done(self, token: Any, wait_started: Any) -> None:
        """Called once the caller waited for it; ``wait_started`` is the ``now()`` mark taken
        before the wait, or None when the caller waited from the issue on (a synchronous
        collective on the host)."""


_CURRENT: BufferObserver | None = None


def current() -> BufferObserver | None:
    """The open observer, or ``None``."""
    return _CURRENT


@contextlib.contextmanager
def observed_by(observer: BufferObserver) -> Iterator[None]:
    """Report to ``observer`` inside the block (one at a time)."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("a run record is already open; close it before opening another")
    _CURRENT = observer
    try:
        yield
    finally:
        _CURRENT = None


_NO_SCOPE = contextlib.nullcontext()


def region(name: str) -> Any:
    """A profiler scope while a profiler runs (profiles and run records count what runs under
    it), else nothing: marking a scope costs the host two dispatched ops and a RecordFunction
    each time, for no reader when none runs."""
    return torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else _NO_SCOPE


def scope(name: str) -> Any:
    """A profiler scope while observed (the record's memory split reads them), else nothing."""
    return torch.profiler.record_function(name) if _CURRENT is not None else _NO_SCOPE

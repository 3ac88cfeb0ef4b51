"""CPU stand-ins that let Megatron-FSDP run on gloo: its CUDA-only calls, replaced while it runs.

Megatron-FSDP (both versions) schedules its collectives on CUDA side streams and orders them
with events, names its device ``cuda:<current_device()>`` and labels ranges for NVTX, so it
refuses a CPU as shipped. On a CPU every kernel runs on the calling thread, in program order,
before the call returns: a stream orders nothing further and an event is always complete, so
dropping them keeps every result and removes only overlap (which a CPU cannot have). Each
replaced call is in :data:`STAND_INS` with why it is exact on a CPU. They are installed only
around Megatron-FSDP's own calls (its set-up and each of its steps, :func:`cpu_stand_ins`), only
when the engine runs on a CPU: on CUDA the real calls run, and the other engines never see them.

What cannot be a stand-in is a setting, chosen where the engine is built (``megatron_engine``):
version 1's ``gradient_reduce_div_fusion=False``, as gloo has no ``PREMUL_SUM``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["STAND_INS", "cpu_stand_ins"]


class _Event:
    """A CUDA event on a CPU: recorded after work that is already done, so always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A CUDA stream on a CPU: the calling thread, where work is already in program order."""

    device = torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_THE_STREAM = _Stream()


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _null_context(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


# (module, attribute, stand-in, why it is exact on a CPU)
STAND_INS: tuple[tuple[Any, str, Any, str], ...] = (
    (torch.cuda, "Stream", _Stream, "one thread runs every kernel in order: a side stream adds only overlap"),
    (torch.cuda, "current_stream", lambda *a, **k: _THE_STREAM, "one thread, one order: the current stream is it"),
    (torch.cuda, "stream", _null_context, "switching streams changes no order on one thread"),
    (torch.cuda, "Event", _Event, "work is complete when its call returns, so every event has fired"),
    (torch.cuda, "device", _null_context, "no device to select: tensors live in host memory"),
    # On the paths the bench runs it only names a device in a warning; an allocation on
    # cuda:0 would fail loudly, never compute elsewhere.
    (torch.cuda, "current_device", lambda: 0, "a device index to name, not a device to compute on"),
    (torch.cuda, "synchronize", _no_op, "nothing is asynchronous to wait for"),
    (torch.Tensor, "cuda", lambda self, *a, **k: self, "the tensor stays in host memory, where gloo reduces it"),
    (torch.cuda.nvtx, "range_push", _no_op, "a profiler label, no computation"),
    (torch.cuda.nvtx, "range_pop", _no_op, "a profiler label, no computation"),
)


@contextlib.contextmanager
def cpu_stand_ins(device: torch.device) -> Iterator[None]:
    """The stand-ins installed while the block runs, when ``device`` is a CPU; otherwise nothing
    changes."""
    if device.type != "cpu":
        yield
        return
    saved = [(owner, name, getattr(owner, name)) for owner, name, _, _ in STAND_INS]
    for owner, name, stand_in, _ in STAND_INS:
        setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)

"""A stand-in for ``torch.cuda``'s stream and event API, so the CUDA path of the collectives
(side streams, event waits, timing events) runs on CPU and leaves a log of what it did."""

import contextlib

import torch

import vescale_plugins.dbuffer.buffer as dbuffer_module
from vescale_plugins.dbuffer.streams import CommStreams


class FakeStreamAPI:
    """``torch.cuda``'s stream calls as a log: streams are names, events are numbers; timing
    events (``Event(enable_timing=True)``) read a clock that advances 1 ms per record."""

    class _Stream:
        def __init__(self, api, name):
            self.api, self.name = api, name

        def wait_stream(self, other):
            self.api.log.append(("wait_stream", self.name, other.name))

        def record_event(self):
            self.api.events += 1
            self.api.log.append(("record", self.name, self.api.events))
            return self.api.events

        def wait_event(self, event):
            self.api.log.append(("wait_event", self.name, event))

    class _TimingEvent:
        def __init__(self, api, enable_timing=False):
            self.api, self.ms = api, None

        def record(self, stream=None):
            stream = stream or self.api.active
            self.api.clock_ms += 1
            self.ms = self.api.clock_ms
            self.api.log.append(("time", stream.name, self.ms))

        def synchronize(self):
            self.api.syncs += 1

        def elapsed_time(self, end):
            return float(end.ms - self.ms)

    def __init__(self):
        self.log, self.events = [], 0
        self.clock_ms, self.syncs = 0, 0
        self.compute = self._Stream(self, "compute")
        self.active = self.compute
        self._names = iter(["all_gather", "reduce_scatter", "all_reduce"])

    def Stream(self, device=None, priority=0):
        return self._Stream(self, next(self._names))

    def Event(self, enable_timing=False):
        return self._TimingEvent(self, enable_timing)

    def current_stream(self, device=None):
        return self.active

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = previous


@contextlib.contextmanager
def stand_in_streams():
    """Every DBuffer's side streams are stand-ins logging to the yielded ``FakeStreamAPI``."""
    api = FakeStreamAPI()
    streams = CommStreams(torch.device("cpu"), api)
    original = dbuffer_module.comm_streams_for
    dbuffer_module.comm_streams_for = lambda device: streams
    try:
        yield api
    finally:
        dbuffer_module.comm_streams_for = original

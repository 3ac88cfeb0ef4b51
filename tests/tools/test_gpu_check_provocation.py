"""The device check's race provocation: where its GPU sleeps land, checked with a stand-in stream API.

``provoked_streams`` puts a ``torch.cuda._sleep`` on the side stream inside every
``CommStreams.issue_on`` (after the stream waited for compute, before the collective), or
only on the reduce-scatter stream (``rs_wait``), and restores ``issue_on`` after.
"""

import contextlib
from types import SimpleNamespace

import torch

from vescale_plugins.dbuffer.streams import CommStreams
from vescale_plugins.tools.gpu_parts.parity import provoked_streams


class _Streams:
    """Just enough of ``torch.cuda``'s stream API for ``CommStreams``: named streams, a current one."""

    def __init__(self, log):
        self.log, self.names = log, iter(["all_gather", "reduce_scatter", "all_reduce"])
        self.current = SimpleNamespace(name="compute")

    def Stream(self, device=None, priority=0):
        return SimpleNamespace(name=next(self.names), wait_stream=lambda other: None, wait_event=lambda event: None)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        yield
        self.current = previous


def _issue_both(streams, log):
    for side in (streams.all_gather, streams.reduce_scatter):
        with streams.issue_on(side):
            log.append(("collective", getattr(side, "name", None)))
    # HSDP's all-reduce follows the reduce-scatter's event, not the compute stream
    with streams.issue_on(streams.all_reduce, after="reduce-scatter done"):
        log.append(("collective", getattr(streams.all_reduce, "name", None)))


def test_sleeps_land_on_the_side_stream_before_each_collective(monkeypatch):
    log = []
    api = _Streams(log)
    streams = CommStreams(torch.device("cpu"), api)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", api.current.name, cycles)))
    original = CommStreams.issue_on
    with provoked_streams(7) as counts:
        _issue_both(streams, log)
    assert log == [
        ("sleep", "all_gather", 7),
        ("collective", "all_gather"),
        ("sleep", "reduce_scatter", 7),
        ("collective", "reduce_scatter"),
        ("sleep", "all_reduce", 7),
        ("collective", "all_reduce"),
    ]
    assert counts == {"side_stream_sleeps": 3}
    assert CommStreams.issue_on is original
    log.clear()
    with provoked_streams(5, which="reduce_scatter") as counts:
        _issue_both(streams, log)
    assert log == [
        ("collective", "all_gather"),
        ("sleep", "reduce_scatter", 5),
        ("collective", "reduce_scatter"),
        ("collective", "all_reduce"),
    ]
    assert counts == {"side_stream_sleeps": 1}
    log.clear()
    _issue_both(CommStreams(torch.device("cpu")), log)  # off CUDA: no streams, no sleep
    with provoked_streams(3):
        _issue_both(CommStreams(torch.device("cpu")), log)
    assert all(entry[0] == "collective" for entry in log)

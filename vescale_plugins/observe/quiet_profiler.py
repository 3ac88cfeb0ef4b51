"""``torch.profiler.profile`` without Kineto's start/stop markers on stderr.

Kineto writes ``USDT: ... profiler_start`` / ``profiler_stop`` (and ``STAGE: ...``) lines to
the process's stderr from C++ on every start and stop, whatever ``KINETO_LOG_LEVEL`` says;
the benchmark starts a profiler several times per step per rank, so those lines buried its
table. This subclass points file descriptor 2 at ``/dev/null`` for the duration of the
start and stop calls only (they are synchronous, and nothing else of ours writes then).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch.profiler

__all__ = ["profile"]


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class profile(torch.profiler.profile):  # lower case: a drop-in for torch.profiler.profile
    """``torch.profiler.profile`` whose start and stop print nothing."""

    def start(self) -> None:
        with _stderr_silenced():
            super().start()

    def stop(self) -> None:
        with _stderr_silenced():
            super().stop()

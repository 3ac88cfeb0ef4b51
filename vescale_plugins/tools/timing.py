"""Timing a call on every rank of a process group, each call started together."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """This rank's median seconds of ``repeats`` calls of ``fn``, each after a barrier (so
    every rank starts it together), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)

"""Measurement tools: an allocation-counting memory tracker and the FSDP2 vs veScale step benchmark.

``python -m vescale_plugins.bench.step_compare --help`` runs the benchmark.
"""

from .memory import BEFORE, AllocationTracker, RegionMemory

__all__ = ["AllocationTracker", "RegionMemory", "BEFORE"]

"""The side-by-side benchmark against FSDP2 and its measurement tools.

``python -m vescale_plugins.bench`` (``make bench``) compares the engines on a Llama-style
decoder; ``python -m vescale_plugins.bench.step_compare`` on a stack of Linear layers.
``AllocationTracker`` counts live tensor bytes from the allocator's own events.
"""

from .memory import BEFORE, AllocationTracker, RegionMemory

__all__ = ["AllocationTracker", "RegionMemory", "BEFORE"]

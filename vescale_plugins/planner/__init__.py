"""Structure-aware layout planning: pack a unit's tensors into buffers with equal shards.

Pure Python (no torch, no process group). Sizes are in elements unless a name says bytes.

* :func:`plan_layout` plans one buffer (the paper's problem) and returns a :class:`Layout`.
* :func:`padding_lower_bound` / :func:`shard_size_lower_bound`: what no single buffer beats.
* :func:`plan_unit` may split a unit into several buffers when a cost model says the padding
  saved pays for the extra collectives; it returns a :class:`UnitPlan`.
"""

from .bounds import padding_lower_bound, shard_size_lower_bound
from .layout import Layout
from .search import plan_layout

__all__ = [
    "Layout",
    "padding_lower_bound",
    "plan_layout",
    "shard_size_lower_bound",
]

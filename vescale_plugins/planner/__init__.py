"""Structure-aware layout planning: pack a unit's tensors into buffers with equal shards.

Pure Python (no torch, no process group). Sizes are in elements unless a name says bytes.

* :func:`plan_layout` plans one buffer (the paper's problem) and returns a :class:`Layout`:
  offsets, one shard size for every rank, and each rank's part of each tensor.
* :func:`padding_lower_bound` / :func:`shard_size_lower_bound`: what no single buffer beats.
* :func:`unit_plan_options` gives a unit's least-padding split (a :class:`UnitPlan`) for
  every buffer budget; :func:`choose_split` picks one under NCCL's collective model
  (:class:`CollectiveCost`), optionally capping the padding;
  :func:`.split_bounds.split_padding_lower_bound` is what no split into k buffers beats.

Guarantees, for every valid input: no block straddles a rank boundary; every tensor is one
contiguous interval and tensors do not overlap; every rank owns exactly ``shard_size``
elements; the same input gives the same layout on every rank, run and hash seed.
"""

from vescale_plugins.planner.bounds import padding_lower_bound, shard_size_lower_bound
from vescale_plugins.planner.cost import CollectiveCost, choose_split
from vescale_plugins.planner.layout import Layout
from vescale_plugins.planner.search import clear_plan_cache, plan_layout
from vescale_plugins.planner.split import UnitPlan, unit_plan_options

__all__ = [
    "CollectiveCost",
    "Layout",
    "UnitPlan",
    "choose_split",
    "clear_plan_cache",
    "padding_lower_bound",
    "plan_layout",
    "shard_size_lower_bound",
    "unit_plan_options",
]

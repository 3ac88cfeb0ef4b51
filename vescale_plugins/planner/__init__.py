"""Structure-aware layout planning: pack a unit's tensors into buffers with equal shards.

Pure Python (no torch, no process group). Sizes are in elements unless a name says bytes.

* :func:`plan_layout` plans one buffer (the paper's problem) and returns a :class:`Layout`:
  offsets, one shard size for every rank, and each rank's part of each tensor.
* :func:`padding_lower_bound` / :func:`shard_size_lower_bound`: what no single buffer beats.
* :func:`plan_unit` may split a unit into several buffers when a cost model says the padding
  saved pays for the extra collectives; it returns a :class:`UnitPlan`.
  :func:`unit_plan_options` gives the least-padding plan for every buffer budget.
* :func:`choose_split` picks the split under the alpha-beta ring model (:class:`RingCost`);
  :func:`.split_bounds.split_padding_lower_bound` is what no split into k buffers beats.

Guarantees, for every valid input: no block straddles a rank boundary; every tensor is one
contiguous interval and tensors do not overlap; every rank owns exactly ``shard_size``
elements; the same input gives the same layout on every rank, run and hash seed.
"""

from vescale_plugins.planner.bounds import padding_lower_bound, shard_size_lower_bound
from vescale_plugins.planner.cost import RingCost, choose_split
from vescale_plugins.planner.layout import Layout
from vescale_plugins.planner.search import clear_plan_cache, plan_layout
from vescale_plugins.planner.split import CostModel, UnitPlan, plan_unit, unit_plan_options

__all__ = [
    "CostModel",
    "Layout",
    "RingCost",
    "UnitPlan",
    "choose_split",
    "clear_plan_cache",
    "padding_lower_bound",
    "plan_layout",
    "plan_unit",
    "shard_size_lower_bound",
    "unit_plan_options",
]

"""``fully_shard``'s set-up does not grow with the world size: no per-rank tuple per
parameter, no per-rank Python loop (torch's fake process group plays rank 0 of W ranks)."""

import tracemalloc

import pytest
import torch
import torch.nn as nn

from tests.support.fake_world import fake_world
from vescale_plugins import fully_shard


@pytest.mark.distributed
def test_set_up_at_a_million_ranks_allocates_less_than_a_byte_per_rank():
    world = 1 << 20
    with fake_world(world) as mesh:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64), nn.LayerNorm(64))
        fully_shard(model[0], mesh=mesh)  # first-call costs (imports, caches) out of the count
        tracemalloc.start()
        try:
            fully_shard(model[1], mesh=mesh)
            fully_shard(model, mesh=mesh)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # One W-tuple of ints (what a per-rank representation costs) is 8 bytes a rank.
        assert peak < world, f"{peak} bytes allocated by fully_shard at W={world}"
        placement = model[1].weight.placements[0]
        assert len(placement.local_units) == world
        assert len(placement.local_units.runs) <= 5

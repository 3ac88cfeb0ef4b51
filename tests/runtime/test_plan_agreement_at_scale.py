"""The plan agreement is one fixed-size exchange, not one pickled object per rank."""

import pytest
import torch.distributed as dist
import torch.nn as nn

from tests.support.fake_world import fake_world
from vescale_plugins import fully_shard


@pytest.mark.distributed
def test_fully_shard_exchanges_no_object_per_rank(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fully_shard gathered one object per rank")

    with fake_world(4096) as mesh:
        monkeypatch.setattr(dist, "all_gather_object", refuse)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

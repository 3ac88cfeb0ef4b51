"""The forecast's per-rank memory equals what ``fully_shard`` allocates, to the byte, at
world sizes far beyond the machine (torch's fake process group plays rank 0 of W ranks;
the model on meta, so only sizes exist)."""

import pytest
import torch
import torch.nn as nn

from tests.support.fake_world import fake_world
from vescale_plugins import fully_shard
from vescale_plugins.forecast.memory import BUFFER_FIGURES, executed_buffer_memory, forecast_memory
from vescale_plugins.forecast.model import spec_from_modules


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(48)
        self.up, self.down = nn.Linear(48, 160), nn.Linear(160, 48, bias=False)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [8, 1024, 16384])
def test_forecast_memory_is_the_executed_buffers_to_the_byte(world):
    with fake_world(world) as mesh:
        with torch.device("meta"):
            model = nn.Sequential(_Block(), _Block(), _Block())
            model.register_parameter("scale", nn.Parameter(torch.ones(48)))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        units = [(f"block{i}", [block]) for i, block in enumerate(model)] + [("root", [model])]
        spec = spec_from_modules("three-blocks", units, {})
        forecast = forecast_memory(spec, world, "fp32", "adamw", (0, 0))["vescale"]
        executed = executed_buffer_memory(model, world)
        assert executed == {k: getattr(forecast, k) for k in BUFFER_FIGURES}
        assert forecast.sharded_grads == forecast.sharded_params

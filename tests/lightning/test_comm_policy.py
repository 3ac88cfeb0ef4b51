"""``comm_policy`` through the Lightning strategies: the Fabric strategy's argument reaches every
unit's buffers (int8 gathers and reductions), a bad value is refused when the strategy is built."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from lightning.fabric import Fabric

from lightning_strategy import VeScaleFSDPFabricStrategy, VeScaleFSDPStrategy
from tests.support.lightning_harness import LAYERS, launched_by_harness
from tests.support.models import Block, make_decoder
from vescale_plugins import QuantizedComm
from vescale_plugins.runtime.state import groups_under


def _comm_policy_reaches_every_unit():
    policy = QuantizedComm(weights="int8", grads="int8", block=128)
    with launched_by_harness():
        fabric = Fabric(
            strategy=VeScaleFSDPFabricStrategy(auto_wrap_policy={Block}, comm_policy=policy),
            accelerator="cpu",
            devices=dist.get_world_size(),
        )
        fabric.launch()
        model = fabric.setup_module(make_decoder(layers=LAYERS)).module
    units = groups_under([model])
    assert len(units) == LAYERS + 1
    for unit in units:
        assert unit.comm_policy == policy
        for dbuffer in unit.dbuffers:
            floating = dbuffer.dtype.is_floating_point
            assert dbuffer.weight_quant_block == (128 if floating else None)
            assert dbuffer.grad_quant_block == (128 if floating else None)


def test_fabric_strategy_passes_comm_policy_to_every_unit(dist_run):
    dist_run(_comm_policy_reaches_every_unit, 2)


@pytest.mark.parametrize("strategy", [VeScaleFSDPStrategy, VeScaleFSDPFabricStrategy])
def test_a_comm_policy_that_is_not_a_quantized_comm_is_refused(strategy):
    with pytest.raises(TypeError, match="comm_policy must be a vescale_plugins.QuantizedComm or None"):
        strategy(comm_policy="int8")

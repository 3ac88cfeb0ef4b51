"""``comm_policy`` through the Accelerate plugin: the field reaches every unit ``prepare``
builds (int8 gathers), and a bad value is refused when the plugin is built."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from accelerate_plugin import VeScaleFSDPPlugin
from tests.support.accelerate_harness import accelerate_env
from tests.support.models import TwoBlocks
from vescale_plugins import QuantizedComm
from vescale_plugins.runtime.state import groups_under


def test_a_comm_policy_that_is_not_a_quantized_comm_is_refused():
    with pytest.raises(TypeError, match="comm_policy must be a vescale_plugins.QuantizedComm or None"):
        VeScaleFSDPPlugin(comm_policy="int8")


def _prepared_units_quantize():
    policy = QuantizedComm(weights="int8", block=64)
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=VeScaleFSDPPlugin(comm_policy=policy), cpu=True)
        model = TwoBlocks()
        model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    units = groups_under([model])
    assert units
    for unit in units:
        assert unit.comm_policy == policy
        assert all(b.weight_quant_block == 64 and b.grad_quant_block is None for b in unit.dbuffers)


@pytest.mark.timeout(600)
def test_accelerate_plugin_passes_comm_policy_to_every_unit(dist_run):
    dist_run(_prepared_units_quantize, 2, timeout=300)

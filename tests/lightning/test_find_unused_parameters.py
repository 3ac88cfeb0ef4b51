"""DDP's data-dependent-routing switch, ``find_unused_parameters``, under the Lightning strategies:
accepted (routing is handled by default, so it changes nothing; ``tests/lightning/test_routing.py``
trains such a model), and rank zero logs one line naming the engine."""

from __future__ import annotations

import io
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_strategy import VeScaleFSDPFabricStrategy, VeScaleFSDPStrategy
from lightning_strategy.model_setup import shard_for_training
from lightning_strategy.options import ShardingOptions
from tests.support.models import TwoBlocks
from vescale_plugins.runtime.state import groups_under


def _lightning_switch_and_log_line():
    import lightning_utilities.core.rank_zero as rank_zero_module
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = io.StringIO()
    logger = logging.getLogger(f"{__name__}.rank{dist.get_rank()}")
    logger.addHandler(logging.StreamHandler(out))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    saved = rank_zero_module.log, getattr(rank_zero_only, "rank", None)
    rank_zero_module.log, rank_zero_only.rank = logger, dist.get_rank()  # as Lightning sets them per rank
    try:
        for enabled in (False, True):
            options = ShardingOptions.from_arguments(None, None, None, None, find_unused_parameters=enabled)
            model = TwoBlocks()
            shard_for_training(model, options, mesh=mesh, device=torch.device("cpu"), mp_policy=MixedPrecisionPolicy())
            assert len(groups_under([model])) == 3  # each block and the root, switch or not
    finally:
        rank_zero_module.log, rank_zero_only.rank = saved
    return out.getvalue()


@pytest.mark.timeout(600)
def test_lightning_find_unused_parameters_reaches_every_unit_and_rank_zero_logs_the_engine(dist_run):
    logs = dist_run(_lightning_switch_and_log_line, 2, timeout=300)
    line = "veScale-FSDP: TwoBlocks sharded as 3 units [<root>, blocks.0, blocks.1] over a 1-D cpu mesh of 2 ranks (gloo)\n"
    assert logs == [line * 2, ""]


def test_strategies_take_find_unused_parameters_and_refuse_non_bools():
    assert VeScaleFSDPStrategy(find_unused_parameters=True)._sharding.find_unused_parameters is True
    assert VeScaleFSDPFabricStrategy(find_unused_parameters=True)._sharding.find_unused_parameters is True
    assert VeScaleFSDPStrategy()._sharding.find_unused_parameters is False
    with pytest.raises(TypeError, match="find_unused_parameters must be True or False"):
        VeScaleFSDPStrategy(find_unused_parameters="yes")

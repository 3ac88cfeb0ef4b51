"""Front ends: DDP's data-dependent-routing switch accepted everywhere (routing is handled by
default, so it changes nothing; tests/test_frontend_routing.py trains such a model), one log line naming
the engine, the same torch threads on every Lightning rank, a warning where a save writes
nothing, and fused AdamW (which the docs now recommend) matching the unfused one."""

from __future__ import annotations

import contextlib
import io
import os
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from accelerate_plugin import VeScaleFSDPPlugin
from accelerate_plugin.plugin import FIND_UNUSED_PARAMETERS_ENV
from lightning_strategy import VeScaleFSDPFabricStrategy, VeScaleFSDPStrategy
from lightning_strategy.model_setup import shard_for_training
from lightning_strategy.options import ShardingOptions
from test_accelerate_parity import accelerate_env
from vescale_plugins import fully_shard
from vescale_plugins.runtime.state import groups_under


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _units(model: nn.Module) -> int:
    return len(groups_under([model]))


def _lightning_switch_and_log_line():
    import logging

    import lightning_utilities.core.rank_zero as rank_zero_module
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = io.StringIO()
    logger = logging.getLogger(f"test_frontend_switches.rank{dist.get_rank()}")
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
            assert _units(model) == 3  # each block and the root, switch or not
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


@pytest.mark.parametrize("strategy_class", [VeScaleFSDPStrategy, VeScaleFSDPFabricStrategy])
def test_every_lightning_rank_gets_the_same_torch_threads_as_under_ddp(monkeypatch, strategy_class):
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    # A rank > 0 under Lightning's launcher: its process was created for it, from outside.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    environment = LightningEnvironment()
    assert environment.creates_processes_externally
    strategy = strategy_class(cluster_environment=environment, parallel_devices=[torch.device("cpu")] * 2)
    strategy._configure_launcher()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, _suggested_max_num_threads(2) + 1))
        strategy.launcher.launch(lambda: None)
        assert torch.get_num_threads() == _suggested_max_num_threads(2)
        assert os.environ["OMP_NUM_THREADS"] == str(_suggested_max_num_threads(2))
    finally:
        torch.set_num_threads(threads)


def test_accelerate_plugin_field_environment_and_ddp_kwargs_routes(monkeypatch):
    monkeypatch.delenv(FIND_UNUSED_PARAMETERS_ENV, raising=False)
    trainer_kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)  # Trainer's ddp_find_unused_parameters
    assert VeScaleFSDPPlugin().resolve_find_unused_parameters(None) is False
    assert VeScaleFSDPPlugin().resolve_find_unused_parameters(trainer_kwargs) is True
    assert VeScaleFSDPPlugin(find_unused_parameters=False).resolve_find_unused_parameters(trainer_kwargs) is False
    monkeypatch.setenv(FIND_UNUSED_PARAMETERS_ENV, "true")  # the accelerate-config / launch route
    assert VeScaleFSDPPlugin().find_unused_parameters is True
    with pytest.raises(TypeError, match="find_unused_parameters must be True, False or None"):
        VeScaleFSDPPlugin(find_unused_parameters="yes")


def _accelerate_prepare(env_value: str | None, ddp_find_unused: bool | None):
    env = {FIND_UNUSED_PARAMETERS_ENV: env_value} if env_value is not None else {}
    with accelerate_env(**env):
        handlers = [DistributedDataParallelKwargs(find_unused_parameters=ddp_find_unused)] if ddp_find_unused is not None else None
        accelerator = Accelerator(fsdp_plugin=VeScaleFSDPPlugin(), cpu=True, kwargs_handlers=handlers)
        model = TwoBlocks()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        return _units(model), out.getvalue()


def _accelerate_routes():
    return [_accelerate_prepare(None, None), _accelerate_prepare(None, True), _accelerate_prepare("1", None)]


@pytest.mark.timeout(600)
def test_accelerate_prepare_honours_the_switch_and_prints_one_line_on_rank_zero(dist_run):
    ranks = dist_run(_accelerate_routes, 2, timeout=300)
    for rank, results in enumerate(ranks):
        assert len({units for units, _ in results}) == 1  # every route prepares the same units
        lines = [line for _, printed in results for line in printed.splitlines() if line.startswith("veScale-FSDP:")]
        assert len(lines) == (3 if rank == 0 else 0)
    assert "over a 1-D cpu mesh of 2 ranks (gloo)" in ranks[0][0][1]


def test_trainer_save_model_warns_where_it_would_write_nothing(monkeypatch):
    transformers_trainer = pytest.importorskip("transformers.trainer")
    from accelerate_plugin import trainer_save

    calls = []
    monkeypatch.setattr(transformers_trainer.Trainer, "save_model", lambda self, output_dir=None, _internal_call=False: calls.append(_internal_call))
    trainer_save.install()
    save_model = transformers_trainer.Trainer.save_model

    def fake_trainer(state_dict_type):
        plugin = VeScaleFSDPPlugin(state_dict_type=state_dict_type)
        return types.SimpleNamespace(accelerator=types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)))

    with pytest.warns(UserWarning, match="writes no model weights with fsdp_state_dict_type SHARDED_STATE_DICT"):
        save_model(fake_trainer("SHARDED_STATE_DICT"), "out")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_model(fake_trainer("FULL_STATE_DICT"), "out")
        save_model(fake_trainer("SHARDED_STATE_DICT"), "out", _internal_call=True)  # the Trainer's own checkpoints
    assert calls == [False, False, True]


def _fused_adamw_matches_unfused():
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = TwoBlocks()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append({name: p.full_tensor() for name, p in model.named_parameters()})
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(600)
def test_fused_adamw_matches_unfused_on_sharded_parameters(dist_run):
    dist_run(_fused_adamw_matches_unfused, 2, timeout=300)

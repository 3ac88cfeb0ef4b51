"""DDP's data-dependent-routing switch, ``find_unused_parameters``, through the Accelerate plugin:
the plugin field, the launch config's environment variable and the Trainer's DDP kwargs all
reach it, every route prepares the same units, and rank zero prints one line naming the engine."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from accelerate_plugin import VeScaleFSDPPlugin
from accelerate_plugin.plugin import FIND_UNUSED_PARAMETERS_ENV
from tests.support.accelerate_harness import accelerate_env
from tests.support.models import TwoBlocks
from vescale_plugins.runtime.state import groups_under


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
        handlers = (
            [DistributedDataParallelKwargs(find_unused_parameters=ddp_find_unused)]
            if ddp_find_unused is not None
            else None
        )
        accelerator = Accelerator(fsdp_plugin=VeScaleFSDPPlugin(), cpu=True, kwargs_handlers=handlers)
        model = TwoBlocks()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        return len(groups_under([model])), out.getvalue()


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

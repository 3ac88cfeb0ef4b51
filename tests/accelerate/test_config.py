"""How a run asks for veScale-FSDP through Accelerate, and how a bad request fails.

The plugin's fields keep their FSDP2 meaning and ``FSDP_*`` variables; the environment route
(``ACCELERATE_USE_VESCALE_FSDP``, set by ``accelerate_plugin.run``) turns the plugin Accelerate
builds from a config, or one ``transformers.Trainer`` passes, into ours; without it the hooks
change nothing. Unsupported options fail with a clear message before any collective runs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import CPUOffloadPolicy, StateDictType
from torch.distributed.tensor import DTensor, Replicate

import accelerate_plugin.hooks as hooks
from accelerate_plugin import VeScaleFSDPPlugin, run
from tests.support.accelerate_harness import accelerate_env, decoder_plugin, fsdp2_launch_env
from tests.support.models import local_batch, loss_fn, make_decoder
from tests.support.parity import adamw
from vescale_plugins import RaggedShard
from vescale_plugins.wrap import is_sharded, shard_model


def two_rows(name: str, param: torch.nn.Parameter) -> int | None:
    """A block size policy for the tests: pairs of rows where the leading dim is even."""
    return 2 if param.dim() == 2 and param.shape[0] % 2 == 0 else None


@pytest.fixture
def clean_fsdp_env(monkeypatch):
    """No ``FSDP_*``/``ACCELERATE_*`` variables from outside, and the environment restored after.

    Restored wholesale: the runner sets ``ACCELERATE_USE_VESCALE_FSDP`` itself, and gloo
    workers started later would inherit it.
    """
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(("FSDP_", "ACCELERATE_")):
            del os.environ[name]
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


# ----------------------------------------------------------------------------------
# the plugin: FSDP2 fields, veScale's block size, refusals at construction
# ----------------------------------------------------------------------------------


def test_plugin_is_fsdp2_and_reads_the_fsdp_variables_of_a_launch_config(clean_fsdp_env):
    assert VeScaleFSDPPlugin().fsdp_version == 2
    for name, value in {
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block,Attention",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
        "FSDP_VESCALE_BLOCK_SIZE_FN": f"{__name__}:two_rows",
    }.items():
        clean_fsdp_env.setenv(name, value)
    plugin = VeScaleFSDPPlugin()
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Attention"]
    assert plugin.reshard_after_forward is False
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert plugin.block_size_fn is two_rows


def test_a_stock_fsdp2_plugin_converts_with_all_its_settings(clean_fsdp_env):
    stock = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=False,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="FULL_STATE_DICT",
        activation_checkpointing=True,
    )
    ours = VeScaleFSDPPlugin.from_fsdp_plugin(stock)
    assert isinstance(ours, VeScaleFSDPPlugin)
    assert VeScaleFSDPPlugin.from_fsdp_plugin(ours) is ours
    for name in (
        "reshard_after_forward",
        "auto_wrap_policy",
        "transformer_cls_names_to_wrap",
        "state_dict_type",
        "activation_checkpointing",
        "cpu_offload",
    ):
        assert getattr(ours, name) == getattr(stock, name), name


def test_fsdp1_configs_are_refused_when_the_plugin_is_built(clean_fsdp_env):
    with pytest.raises(ValueError, match="fsdp_version=1.*accelerate to-fsdp2"):
        VeScaleFSDPPlugin(fsdp_version=1)
    clean_fsdp_env.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version=1"):
        VeScaleFSDPPlugin()
    with pytest.raises(ValueError, match="fsdp_version=1"):
        VeScaleFSDPPlugin.from_fsdp_plugin(FullyShardedDataParallelPlugin())
    clean_fsdp_env.delenv("FSDP_VERSION")
    # fsdp_offload_params: FSDP2's CPUOffloadPolicy, which fully_shard takes (see test_parity)
    assert VeScaleFSDPPlugin(cpu_offload=True).cpu_offload == CPUOffloadPolicy()
    with pytest.raises(ValueError, match="module:function"):
        VeScaleFSDPPlugin(block_size_fn="no_colon_here")
    with pytest.raises(ValueError, match="cannot be imported"):
        VeScaleFSDPPlugin(block_size_fn=f"{__name__}:missing")


def test_unknown_precision_and_multi_dimensional_meshes_are_refused(clean_fsdp_env):
    plugin = VeScaleFSDPPlugin()
    plugin.check_accelerator_options("bf16", ParallelismConfig(dp_shard_size=2))
    with pytest.raises(ValueError, match="mixed_precision='fp12'.*'no', 'fp16', 'bf16'"):
        plugin.check_accelerator_options("fp12", None)
    with pytest.raises(ValueError, match="'fp8'"):
        plugin.check_accelerator_options("fp8", None)
    plugin.check_accelerator_options("no", ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))  # HSDP
    plugin.check_accelerator_options("no", ParallelismConfig(tp_size=2, dp_shard_size=2))  # TP x FSDP
    with pytest.raises(ValueError, match="tp_size=2 but dp_shard_size=1: veScale-FSDP would have no data-parallel dim"):
        plugin.check_accelerator_options("no", ParallelismConfig(tp_size=2, dp_shard_size=1))
    with pytest.raises(NotImplementedError, match="cp_size"):
        plugin.check_accelerator_options("no", ParallelismConfig(cp_size=2))


def test_a_wrap_policy_naming_no_module_lists_the_model_classes(clean_fsdp_env):
    plugin = VeScaleFSDPPlugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Blok"])
    with pytest.raises(ValueError, match=r"\['Blok'\].*Decoder has no module of that class.*'Block'"):
        plugin.set_auto_wrap_policy(make_decoder())


def test_hooks_leave_stock_accelerate_alone(clean_fsdp_env):
    calls = []
    clean_fsdp_env.setattr(hooks, "_original_prepare_model", lambda accelerator, model: calls.append(model) or model)

    class FakeAccelerator:
        class state:
            fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)

    model = torch.nn.Linear(2, 2)
    import accelerate.accelerator

    assert accelerate.accelerator.fsdp2_prepare_model(FakeAccelerator(), model) is model
    assert calls == [model]
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator()
        assert accelerator.distributed_type == DistributedType.NO
        assert getattr(accelerator.state, "fsdp_plugin", None) is None
    finally:
        AcceleratorState._reset_state(True)


# ----------------------------------------------------------------------------------
# the runner accelerate launch starts: python -m accelerate_plugin.run SCRIPT | -m MODULE
# ----------------------------------------------------------------------------------

PROBE = """
import json, os, sys
json.dump({"name": __name__, "argv": sys.argv[1:], "requested": os.environ.get("ACCELERATE_USE_VESCALE_FSDP")}, open(sys.argv[1], "w"))
"""


def test_runner_runs_a_script_or_module_as_main_with_vescale_requested(tmp_path, clean_fsdp_env):
    (tmp_path / "probe_script.py").write_text(PROBE)
    (tmp_path / "vescale_probe_module.py").write_text(PROBE)
    clean_fsdp_env.setattr("sys.argv", ["pytest"])
    clean_fsdp_env.syspath_prepend(str(tmp_path))
    out = tmp_path / "out.json"
    run.main([str(tmp_path / "probe_script.py"), str(out), "--flag"])
    assert json.loads(out.read_text()) == {"name": "__main__", "argv": [str(out), "--flag"], "requested": "1"}
    out.unlink()
    run.main(["-m", "vescale_probe_module", str(out)])
    assert json.loads(out.read_text()) == {"name": "__main__", "argv": [str(out)], "requested": "1"}
    with pytest.raises(SystemExit, match="usage"):
        run.main([])


# ----------------------------------------------------------------------------------
# on gloo ranks
# ----------------------------------------------------------------------------------


def _bad_configurations_fail_on_one_rank_alone() -> list[str] | None:
    # Only rank 0 tries; rank 1 runs nothing. A collective on rank 0 would wait forever for
    # rank 1, so finishing within the timeout shows each error came before any collective.
    if dist.get_rank() != 0:
        return None
    messages = []
    with accelerate_env(), pytest.raises(ValueError, match="mixed_precision='fp12'") as error:
        Accelerator(mixed_precision="fp12", fsdp_plugin=decoder_plugin())
    messages.append(str(error.value))
    with accelerate_env(), pytest.raises(ValueError, match="tp_size=2 but dp_shard_size=1") as error:
        Accelerator(fsdp_plugin=decoder_plugin(), parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=1))
    messages.append(str(error.value))
    with accelerate_env():
        accelerator = Accelerator(
            fsdp_plugin=VeScaleFSDPPlugin(
                auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["NoSuchBlock"]
            )
        )
        model = make_decoder()
        with pytest.raises(ValueError, match="NoSuchBlock") as error:
            accelerator.prepare(model, adamw(model))
        assert not is_sharded(model)
        assert not any(isinstance(p, DTensor) for p in model.parameters())
    messages.append(str(error.value))
    return messages


def test_bad_configuration_fails_with_a_clear_message_before_any_collective(dist_run):
    messages = dist_run(_bad_configurations_fail_on_one_rank_alone, 2, timeout=60)[0]
    assert "mixed_precision='fp12'" in messages[0]
    assert "tp_size=2 but dp_shard_size=1" in messages[1]
    assert "set dp_shard_size > 1" in messages[1]
    assert "NoSuchBlock" in messages[2]
    assert "Block" in messages[2]


def _train_one_step(accelerator: Accelerator) -> torch.nn.Module:
    model = make_decoder()
    optimizer = adamw(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens, targets = local_batch(0)
    accelerator.backward(loss_fn(model(tokens), targets))
    optimizer.step()
    return model


def _sharded_by_vescale(model: torch.nn.Module) -> bool:
    return all(isinstance(p, DTensor) and isinstance(p.placements[0], RaggedShard) for p in model.parameters())


def _environment_route() -> None:
    launch_config = fsdp2_launch_env("Block", FSDP_RESHARD_AFTER_FORWARD="false")
    # What `accelerate launch` with an FSDP2 config and the runner give a script that builds
    # `Accelerator()` itself.
    with accelerate_env(**launch_config, ACCELERATE_USE_VESCALE_FSDP="1"):
        accelerator = Accelerator()
        plugin = accelerator.state.fsdp_plugin
        assert isinstance(plugin, VeScaleFSDPPlugin)
        assert plugin.reshard_after_forward is False
        assert accelerator.distributed_type == DistributedType.FSDP
        model = _train_one_step(accelerator)
        assert _sharded_by_vescale(model)
        assert all(is_sharded(layer) for layer in model.layers)
    # What transformers.Trainer does with --fsdp arguments: build a stock plugin itself.
    with accelerate_env(ACCELERATE_USE_VESCALE_FSDP="1"):
        stock = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
        )
        accelerator = Accelerator(fsdp_plugin=stock)
        assert isinstance(accelerator.state.fsdp_plugin, VeScaleFSDPPlugin)
        assert _sharded_by_vescale(_train_one_step(accelerator))
    # A ParallelismConfig with only a data-parallel shard dim is a 1-D mesh: accepted.
    with accelerate_env():
        accelerator = Accelerator(
            fsdp_plugin=decoder_plugin(), parallelism_config=ParallelismConfig(dp_shard_size=dist.get_world_size())
        )
        assert _sharded_by_vescale(_train_one_step(accelerator))
    # Without the variable the hooks stay out of the way, whatever stock Accelerate then does
    # (under torchrun on a machine without GPUs: every process trains alone).
    with accelerate_env(**launch_config):
        accelerator = Accelerator()
        assert not isinstance(getattr(accelerator.state, "fsdp_plugin", None), VeScaleFSDPPlugin)
        if not torch.cuda.is_available():
            assert accelerator.distributed_type == DistributedType.NO


def test_environment_route_covers_configs_and_trainer_built_plugins(dist_run):
    dist_run(_environment_route, 2)


def _prepared_model(plugin: VeScaleFSDPPlugin) -> torch.nn.Module:
    with accelerate_env():
        return _train_one_step(Accelerator(fsdp_plugin=plugin))


def _units(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_vescale_fsdp_unit", None) is not None]


def _unit_choice_and_block_sizes_follow_the_plugin() -> None:
    assert _units(_prepared_model(VeScaleFSDPPlugin(auto_wrap_policy="no_wrap"))) == [""]
    size_based = _prepared_model(VeScaleFSDPPlugin(auto_wrap_policy="size_based_wrap", min_num_params=4000))
    big = {name for name, m in make_decoder().named_modules() if name and sum(p.numel() for p in m.parameters()) > 4000}
    big.remove("layers")  # a ModuleList has no forward, so it cannot be a unit
    assert set(_units(size_based)) == big | {""}
    ignoring = _prepared_model(decoder_plugin(ignored_modules="norm"))
    assert not any(isinstance(p, DTensor) for p in ignoring.norm.parameters())
    assert all(isinstance(p, DTensor) for p in ignoring.layers.parameters())
    blocked = _prepared_model(decoder_plugin(block_size_fn=two_rows))
    for name, p in blocked.named_parameters():
        if two_rows(name, p) == 2:
            assert p.to_local().shape[0] % 2 == 0, name


def test_wrap_policies_ignored_modules_and_block_size_follow_the_plugin(dist_run):
    dist_run(_unit_choice_and_block_sizes_follow_the_plugin, 3)


def _hybrid_sharding_from_a_parallelism_config():
    """``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``: HSDP, as FSDP2 under
    Accelerate; one step equals plain ``fully_shard`` on the same 2-D mesh."""
    with accelerate_env():
        accelerator = Accelerator(
            fsdp_plugin=decoder_plugin(), parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
        )
        model = _train_one_step(accelerator)
    mesh = next(model.parameters()).device_mesh
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert tuple(mesh.shape) == (2, 2)
    for p in model.parameters():
        assert p.device_mesh.ndim == 2
        assert p.placements[0] == Replicate()
        assert isinstance(p.placements[1], RaggedShard)
    plain = make_decoder()
    shard_model(plain, mesh=mesh)
    optimizer = adamw(plain)
    tokens, targets = local_batch(0)
    loss_fn(plain(tokens), targets).backward()
    optimizer.step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_parallelism_config_with_replicas_gives_hybrid_sharding(dist_run):
    dist_run(_hybrid_sharding_from_a_parallelism_config, 4)

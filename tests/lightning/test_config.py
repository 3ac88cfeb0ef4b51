"""Registration and configuration of the Lightning strategies, in one process and without collectives.

Bad configuration must fail when the Trainer / Fabric / strategy is built, before any process
is launched: nothing here initialises a process group.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_strategy import VeScaleFSDPFabricStrategy, VeScaleFSDPStrategy
from lightning_strategy.checkpoints import check_optimizer_state_keys
from lightning_strategy.options import ShardingOptions, build_device_mesh
from tests.support.models import Block, make_decoder

STRATEGIES = [VeScaleFSDPStrategy, VeScaleFSDPFabricStrategy]


def _trainer(**kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, **kwargs)


def _fabric(**kwargs) -> Fabric:
    return Fabric(accelerator="cpu", devices=2, **kwargs)


def test_import_registers_vescale_fsdp_with_the_trainer_and_fabric():
    assert StrategyRegistry["vescale_fsdp"]["strategy"] is VeScaleFSDPStrategy
    assert STRATEGY_REGISTRY["vescale_fsdp"]["strategy"] is VeScaleFSDPFabricStrategy
    trainer = _trainer(strategy="vescale_fsdp")
    assert isinstance(trainer.strategy, VeScaleFSDPStrategy)
    assert trainer._accelerator_connector.is_distributed  # DistributedSampler and sync_dist are on
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert isinstance(_fabric(strategy="vescale_fsdp").strategy, VeScaleFSDPFabricStrategy)
    assert _trainer(strategy="vescale_fsdp", num_nodes=2).strategy.num_nodes == 2


BF16_MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize(
    ("precision", "policy", "module_dtype"),
    [
        ("32-true", MixedPrecisionPolicy(), torch.float32),
        ("bf16-mixed", BF16_MIXED, torch.float32),
        ("bf16-true", MixedPrecisionPolicy(), torch.bfloat16),
    ],
)
def test_precision_maps_to_the_mixed_precision_policy(precision, policy, module_dtype):
    trainer_strategy = _trainer(strategy="vescale_fsdp", precision=precision).strategy
    fabric_strategy = _fabric(strategy="vescale_fsdp", precision=precision).strategy
    for strategy, plugin in (
        (trainer_strategy, trainer_strategy.precision_plugin),
        (fabric_strategy, fabric_strategy.precision),
    ):
        assert strategy.mp_policy == policy
        assert plugin.convert_module(make_decoder(layers=1)).embed.weight.dtype == module_dtype
    explicit = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert (
        _trainer(strategy=VeScaleFSDPStrategy(mp_policy=explicit), precision=precision).strategy.mp_policy == explicit
    )


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_fails_when_the_trainer_is_built(precision):
    # The strategies are FSDPStrategy subclasses, so Lightning's connectors first build an
    # FSDPPrecision, which refuses "64-true" itself; "16-true" it takes, and we refuse it.
    ours = precision == "16-true"
    message = "is not supported by the vescale_fsdp strategy; use one of" if ours else "is not supported in FSDP"
    with pytest.raises(ValueError, match=rf"precision='{precision}'\)?`? {message}"):
        _trainer(strategy="vescale_fsdp", precision=precision)
    with pytest.raises(ValueError, match=rf"precision='{precision}'\)?`? is not supported"):
        _fabric(strategy="vescale_fsdp", precision=precision)


def test_parallel_sizes_that_do_not_cover_the_processes_fail_before_the_mesh_is_built():
    # Raised before init_device_mesh (no process group exists here), the same on every rank.
    with pytest.raises(ValueError, match="data_parallel_size=3 x tensor_parallel_size=2 must equal the 4 processes"):
        build_device_mesh(None, 4, torch.device("cpu"), 3, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 4 processes"):
        build_device_mesh(None, 4, torch.device("cpu"), "auto", 3)


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
def test_bad_strategy_arguments_fail_when_the_strategy_is_built(strategy_cls):
    with pytest.raises(NotImplementedError, match=r"device_mesh with 3 dimensions: veScale-FSDP takes a 1-D mesh"):
        strategy_cls(device_mesh=(2, 2, 2))
    with pytest.raises(ValueError, match="tensor_parallel_size=0: use a number of processes >= 1"):
        strategy_cls(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size='all': use 'auto' or a number"):
        strategy_cls(data_parallel_size="all")
    with pytest.raises(ValueError, match="pass either device_mesh or data_parallel_size / tensor_parallel_size"):
        strategy_cls(device_mesh=(2, 2), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="state_dict_type='distributed': use 'sharded'"):
        strategy_cls(state_dict_type="distributed")
    with pytest.raises(ValueError, match="reshard_after_forward=0"):
        strategy_cls(reshard_after_forward=0)
    with pytest.raises(TypeError, match="FSDP1-style predicates"):
        strategy_cls(auto_wrap_policy=lambda module, recurse, nonwrapped_numel: True)
    with pytest.raises(TypeError, match="must name nn.Module classes"):
        strategy_cls(auto_wrap_policy={int})
    with pytest.raises(TypeError, match="mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy"):
        strategy_cls(mp_policy=torch.bfloat16)


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
def test_cpu_offload_takes_lightnings_fsdp_strategy_forms(strategy_cls):
    """As Lightning's FSDPStrategy: a bool or FSDP1's CPUOffload; FSDP2's policy too."""
    for cpu_offload, policy in [
        (True, CPUOffloadPolicy()),
        (CPUOffload(offload_params=True), CPUOffloadPolicy()),
        (CPUOffloadPolicy(pin_memory=False), CPUOffloadPolicy(pin_memory=False)),
        (False, None),
        (CPUOffload(offload_params=False), None),
    ]:
        assert strategy_cls(cpu_offload=cpu_offload)._sharding.offload_policy == policy, cpu_offload
    with pytest.raises(TypeError, match="cpu_offload must be a bool, torch.distributed.fsdp.CPUOffload"):
        strategy_cls(cpu_offload="cpu")


def test_wrap_policy_picks_units_like_lightnings_fsdp_strategy():
    model = make_decoder(layers=2)
    blocks = list(model.layers)
    assert ShardingOptions.from_arguments(None, None, None, None).units(model) == blocks  # every ModuleList block
    for policy in ({Block}, {"Block"}, Block, ModuleWrapPolicy({Block}), lambda m: list(m.layers)):
        assert ShardingOptions.from_arguments(policy, None, None, None).units(model) == blocks
    with pytest.raises(
        ValueError, match=r"names \['Layer'\], but Decoder contains no module .* \(it contains: .*'Block'"
    ):
        ShardingOptions.from_arguments({"Layer"}, None, None, None).units(model)
    with pytest.raises(ValueError, match="not submodules of Decoder"):
        ShardingOptions.from_arguments(lambda m: [m], None, None, None).units(model)


def test_optimizer_state_keyed_by_index_is_refused_with_a_clear_message():
    model = make_decoder(layers=1)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="keyed by parameter index .* start a fresh optimizer"):
        check_optimizer_state_keys(optimizer.state_dict())
    check_optimizer_state_keys({"state": {"embed.weight": {}}, "param_groups": []})


@pytest.mark.parametrize("strategy_class", STRATEGIES)
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

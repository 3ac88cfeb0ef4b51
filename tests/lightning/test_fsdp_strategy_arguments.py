"""Both strategies take Lightning ``FSDPStrategy``'s arguments and pass its ``isinstance`` checks.

Code written for ``lightning.{pytorch,fabric}.strategies.FSDPStrategy`` (LitGPT's pretrain:
``sharding_strategy="HYBRID_SHARD"``; its full fine-tune: ``limit_all_gathers=True``) runs with
ours swapped in: every argument of Lightning's signature (read from the installed Lightning, so
a new one fails here) is accepted, mapped where it has a meaning, and the checks trainers make
with ``isinstance(strategy, FSDPStrategy)`` take the FSDP branch. At W=2, Fabric and Trainer runs
with the FSDP1 spellings train as the same run without them, LitGPT's checkpoint-loading branch
loads a plain checkpoint, and FSDP1's ignored modules are neither sharded nor reduced.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDPStrategy
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.tensor import DTensor

import lightning_strategy.common
import lightning_strategy.fabric
import lightning_strategy.strategy
from lightning_strategy import VeScaleFSDPFabricStrategy, VeScaleFSDPPrecision, VeScaleFSDPStrategy
from lightning_strategy.fsdp_arguments import FSDP1_KEYWORDS, NODES_MESH, REPLICATE_MESH, resolve_mesh_request
from tests.support.lightning_harness import (
    LAYERS,
    LitDecoder,
    Tokens,
    dataset,
    launched_by_harness,
    loader,
    make_fabric,
    make_trainer,
)
from tests.support.models import Block, loss_fn, make_decoder
from tests.support.parity import PARAM_TOL, TOL, adamw, assert_same_params, full_params

PAIRS = [(VeScaleFSDPStrategy, TrainerFSDPStrategy), (VeScaleFSDPFabricStrategy, FabricFSDPStrategy)]
STRATEGIES = [ours for ours, _ in PAIRS]
# A value for each FSDP1 keyword Lightning's FSDPStrategy forwards, and what ours does with it.
ACCEPTED_FSDP1 = dict(
    limit_all_gathers=True,
    use_orig_params=True,
    device_id=0,
    sync_module_states=True,
    forward_prefetch=False,
    backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    ignored_modules=[nn.Linear(1, 1)],
    ignored_states=None,
)
REFUSED_FSDP1 = dict(param_init_fn=print, process_group=object())


def _named_parameters(cls):
    return [p for p in inspect.signature(cls.__init__).parameters.values() if p.kind is not p.VAR_KEYWORD][1:]


@pytest.mark.parametrize(("ours", "lightnings"), PAIRS)
def test_every_argument_of_lightnings_fsdp_strategy_is_ours_in_its_position(ours, lightnings):
    theirs = [p.name for p in _named_parameters(lightnings)]
    assert [p.name for p in _named_parameters(ours)][: len(theirs)] == theirs  # positional calls work too
    assert any(p.kind is p.VAR_KEYWORD for p in inspect.signature(ours.__init__).parameters.values())
    # Lightning's own defaults (FULL_SHARD; the Trainer's state_dict_type="full") are accepted.
    defaults = {p.name: p.default for p in _named_parameters(lightnings) if p.default is not p.empty}
    strategy = ours(**defaults)
    assert strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert strategy._sharding.reshard_after_forward is None  # FSDP1's FULL_SHARD keeps the root gathered too


@pytest.mark.parametrize("ours", STRATEGIES)
def test_every_fsdp1_keyword_is_accepted_or_refused_with_what_to_do(ours):
    assert set(ACCEPTED_FSDP1) | set(REFUSED_FSDP1) == FSDP1_KEYWORDS  # a new FSDP1 keyword fails here
    strategy = ours(**ACCEPTED_FSDP1)
    assert strategy._sharding.sync_module_states is True
    assert strategy._sharding.forward_prefetch is False
    assert strategy._sharding.backward_prefetch is True
    assert ours(backward_prefetch=None)._sharding.backward_prefetch is False
    linear = nn.Linear(2, 2)
    assert ours(ignored_modules=[linear])._sharding.ignored_params() == {linear.weight, linear.bias}
    assert ours(ignored_states=[linear.weight])._sharding.ignored_params() == {linear.weight}
    with pytest.raises(ValueError, match="either ignored_modules or ignored_states, not both"):
        ours(ignored_modules=[linear], ignored_states=[linear.bias])
    with pytest.raises(TypeError, match="ignored_modules must hold nn.Module objects"):
        ours(ignored_modules=[linear.weight])
    for name, value in REFUSED_FSDP1.items():
        with pytest.raises(NotImplementedError, match=rf"{name}= \(an FSDP1 option\) is not supported"):
            ours(**{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'limit_allgathers': neither Lightning's"):
        ours(limit_allgathers=True)
    with pytest.raises(TypeError, match="sync_module_states must be True or False"):
        ours(sync_module_states="yes")


@pytest.mark.parametrize("ours", STRATEGIES)
@pytest.mark.parametrize(
    ("sharding_strategy", "reshard_after_forward", "mesh_request", "mesh_2_nodes_x_4"),
    [
        ("FULL_SHARD", None, None, (8,)),
        ("SHARD_GRAD_OP", False, None, (8,)),
        ("HYBRID_SHARD", None, NODES_MESH, (2, 4)),
        ("_HYBRID_SHARD_ZERO2", False, NODES_MESH, (2, 4)),
        ("NO_SHARD", False, REPLICATE_MESH, (8, 1)),
    ],
)
def test_sharding_strategy_is_a_mesh_and_reshard_after_forward(
    ours, sharding_strategy, reshard_after_forward, mesh_request, mesh_2_nodes_x_4
):
    for spelling in (sharding_strategy, sharding_strategy.lower(), ShardingStrategy[sharding_strategy]):
        strategy = ours(sharding_strategy=spelling, auto_wrap_policy={Block})
        assert strategy.sharding_strategy == ShardingStrategy[sharding_strategy]
        assert strategy._sharding.reshard_after_forward is reshard_after_forward
        assert strategy._device_mesh_request == mesh_request
        assert (resolve_mesh_request(mesh_request, 2, 8) or (8,)) == mesh_2_nodes_x_4


@pytest.mark.parametrize("ours", STRATEGIES)
def test_sharding_strategy_conflicts_name_both_arguments(ours):
    assert ours(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4))._device_mesh_request == (2, 4)
    assert ours(device_mesh=(2, 4)).sharding_strategy == ShardingStrategy.HYBRID_SHARD
    assert ours(reshard_after_forward=False).sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    with pytest.raises(ValueError, match="either sharding_strategy='SHARD_GRAD_OP' or reshard_after_forward=True"):
        ours(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=True)
    with pytest.raises(ValueError, match="'FULL_SHARD' shards over every rank, but device_mesh=\\(2, 4\\) is 2-D"):
        ours(sharding_strategy="FULL_SHARD", device_mesh=(2, 4))
    with pytest.raises(ValueError, match="'HYBRID_SHARD' needs a 2-D device_mesh"):
        ours(sharding_strategy="HYBRID_SHARD", device_mesh=(8,))
    with pytest.raises(ValueError, match="either sharding_strategy='NO_SHARD' .* or device_mesh"):
        ours(sharding_strategy="NO_SHARD", device_mesh=(8,))
    with pytest.raises(ValueError, match="cannot be combined with data_parallel_size / tensor_parallel_size"):
        ours(sharding_strategy="HYBRID_SHARD", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="sharding_strategy='ZERO3': use one of 'FULL_SHARD'"):
        ours(sharding_strategy="ZERO3")


@pytest.mark.parametrize("ours", STRATEGIES)
def test_fsdp1_mixed_precision_is_our_policy(ours):
    fsdp1 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    strategy = ours(mixed_precision=fsdp1)
    assert strategy.mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    in_force = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    assert strategy.mixed_precision_config == in_force  # what Lightning's FSDPStrategy calls it
    assert strategy.mixed_precision is fsdp1
    no_cast = MixedPrecision(param_dtype=torch.bfloat16, cast_root_forward_inputs=False)
    assert ours(mixed_precision=no_cast).mp_policy.cast_forward_inputs is False
    with pytest.raises(ValueError, match="either mixed_precision .* or mp_policy .*, not both"):
        ours(mixed_precision=fsdp1, mp_policy=MixedPrecisionPolicy())
    with pytest.raises(TypeError, match="mixed_precision must be a torch.distributed.fsdp.MixedPrecision"):
        ours(mixed_precision=MixedPrecisionPolicy())


@pytest.mark.parametrize("ours", STRATEGIES)
def test_activation_checkpointing_is_the_policy_by_its_older_name(ours):
    assert ours(activation_checkpointing=Block)._layer_checkpointing.classes == (Block,)
    assert ours(activation_checkpointing=[Block, nn.Linear])._layer_checkpointing.classes in (
        (Block, nn.Linear),
        (nn.Linear, Block),
    )
    with pytest.raises(ValueError, match="either activation_checkpointing or activation_checkpointing_policy"):
        ours(activation_checkpointing=Block, activation_checkpointing_policy={Block})


@pytest.mark.parametrize(("ours", "lightnings"), PAIRS)
def test_ours_is_an_fsdp_strategy_that_runs_none_of_fsdp1(ours, lightnings):
    assert isinstance(ours(), lightnings)
    bookkeeping = {"__abstractmethods__", "__annotations__", "__doc__", "__module__", "_abc_impl", "__init__"}
    for name in set(vars(lightnings)) - bookkeeping:
        assert inspect.getattr_static(ours, name) is not inspect.getattr_static(lightnings, name), name
    # super() from our methods would reach FSDPStrategy's: the strategies call ParallelStrategy's by name.
    for module in (lightning_strategy.strategy, lightning_strategy.fabric, lightning_strategy.common):
        assert "super()." not in inspect.getsource(module)


def test_the_trainers_fsdp_branches_build_our_precision_and_a_distributed_run():
    trainer = Trainer(
        strategy=VeScaleFSDPStrategy(), accelerator="cpu", devices=2, precision="bf16-mixed", logger=False
    )
    assert isinstance(trainer.strategy, TrainerFSDPStrategy)  # the connector built an FSDPPrecision: translated
    assert isinstance(trainer.strategy.precision_plugin, VeScaleFSDPPrecision)
    assert trainer.strategy.mp_policy.param_dtype == torch.bfloat16
    assert trainer._accelerator_connector.is_distributed


# -- W=2 Fabric runs --------------------------------------------------------------------

GLOBAL_BATCH, STEPS, CLIP = 4, 3, 0.5
DATA = Tokens(GLOBAL_BATCH * STEPS)


def _train(**strategy_kwargs):
    """Three clipped AdamW steps of the test decoder; the losses, norms, parameters and mesh."""
    fabric = make_fabric(VeScaleFSDPFabricStrategy(auto_wrap_policy={Block}, **strategy_kwargs))
    assert isinstance(fabric.strategy, FabricFSDPStrategy)
    torch.manual_seed(dist.get_rank())  # sync_module_states: every rank but 0 builds other weights
    model = make_decoder(seed=0 if "sync_module_states" not in strategy_kwargs else dist.get_rank(), layers=LAYERS)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(adamw(model))
    losses, norms = [], []
    per_rank = GLOBAL_BATCH // fabric.world_size
    for step in range(STEPS):
        first = step * GLOBAL_BATCH + fabric.global_rank * per_rank
        tokens, targets = DATA[first : first + per_rank]
        loss = loss_fn(model(tokens), targets)
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    mesh = fabric.strategy.device_mesh
    return losses, norms, full_params(model.module), (tuple(mesh.shape), mesh.mesh_dim_names)


def _fsdp1_spellings_train_as_the_plain_run():
    with launched_by_harness():
        want_losses, want_norms, want_params, mesh = _train()
        assert mesh == ((2,), None)
        for kwargs, want_mesh in (
            # LitGPT's pretrain and full fine-tune; 2 processes are 1 node x 2 devices.
            (dict(sharding_strategy="HYBRID_SHARD", limit_all_gathers=True), ((1, 2), ("replicate", "shard"))),
            (dict(sharding_strategy="SHARD_GRAD_OP", use_orig_params=True, forward_prefetch=False), ((2,), None)),
            (dict(sharding_strategy="NO_SHARD", backward_prefetch=None), ((2, 1), ("replicate", "shard"))),
            (dict(sync_module_states=True), ((2,), None)),
        ):
            losses, norms, params, got_mesh = _train(**kwargs)
            assert got_mesh == want_mesh, kwargs
            torch.testing.assert_close(losses, want_losses, **TOL, msg=str(kwargs))
            torch.testing.assert_close(norms, want_norms, **TOL, msg=str(kwargs))
            assert_same_params(params, want_params, PARAM_TOL)


def test_fsdp1_spellings_train_as_the_plain_run(dist_run):
    dist_run(_fsdp1_spellings_train_as_the_plain_run, 2, timeout=240)


def _load_checkpoint_as_litgpt_does(fabric, model, path, strict=True):
    """LitGPT 0.5.13's ``litgpt.utils.load_checkpoint``, its ModelParallel branch left out."""
    from lightning.fabric.strategies import FSDPStrategy

    if isinstance(fabric.strategy, FSDPStrategy):
        fabric.load_raw(path, model, strict=strict)
    else:
        model.load_state_dict(torch.load(path), strict=strict)


def _litgpt_branches(root):
    with launched_by_harness():
        fabric = make_fabric(VeScaleFSDPFabricStrategy(auto_wrap_policy={Block}, limit_all_gathers=True))
        plain = make_decoder(seed=5, layers=LAYERS)
        if fabric.global_rank == 0:
            torch.save(plain.state_dict(), f"{root}/lit_model.pth")
        fabric.barrier()
        with fabric.init_module(empty_init=True):
            model = make_decoder(layers=LAYERS)
        # Fabric's FSDP branch: an optimizer over meta-device parameters is refused, as for FSDPStrategy.
        with pytest.raises(RuntimeError, match="references to the model's meta-device parameters"):
            fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        model = fabric.setup_module(model)
        _load_checkpoint_as_litgpt_does(fabric, model, f"{root}/lit_model.pth")
        assert_same_params(full_params(model.module), dict(plain.named_parameters()), PARAM_TOL)


def test_litgpts_fsdp_branch_loads_a_plain_checkpoint_into_a_meta_built_model(dist_run, tmp_path):
    dist_run(_litgpt_branches, 2, str(tmp_path), timeout=240)


def _ignored_modules_are_neither_sharded_nor_reduced():
    with launched_by_harness():
        model = make_decoder(seed=0, layers=LAYERS)
        ignored = [model.norm, model.layers[0]]  # a module of the root unit, and a whole unit
        fabric = make_fabric(VeScaleFSDPFabricStrategy(auto_wrap_policy={Block}, ignored_modules=ignored))
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        ignored_names = {n for n, _ in model.module.named_parameters() if n.startswith(("norm.", "layers.0."))}
        assert ignored_names
        for name, p in model.module.named_parameters():
            assert isinstance(p, DTensor) is (name not in ignored_names), name
        tokens, targets = DATA[2 * fabric.global_rank : 2 * fabric.global_rank + 2]  # other data on each rank
        fabric.backward(loss_fn(model(tokens), targets))
        optimizer.step()
        for name, p in model.module.named_parameters():
            if name in ignored_names:  # local gradients, as FSDP1 leaves them: the ranks' copies part
                gathered = [torch.empty_like(p) for _ in range(2)]
                dist.all_gather(gathered, p.detach())
                assert not torch.equal(gathered[0], gathered[1]), name


def test_ignored_modules_are_neither_sharded_nor_reduced(dist_run):
    dist_run(_ignored_modules_are_neither_sharded_nor_reduced, 2, timeout=240)


# -- W=2 Trainer run ---------------------------------------------------------------------


def _trainer_fit(root, strategy):
    seed_everything(0)
    module = LitDecoder()
    trainer = make_trainer(root, strategy=strategy)
    assert isinstance(trainer.strategy, TrainerFSDPStrategy)
    trainer.fit(module, loader(dataset(dist.get_world_size())))
    mesh = trainer.strategy.device_mesh
    return module.global_losses, full_params(module, prefix="model."), (tuple(mesh.shape), mesh.mesh_dim_names)


def _trainer_hybrid_shard_trains_as_the_plain_run(root):
    with launched_by_harness():
        want_losses, want_params, _ = _trainer_fit(f"{root}/plain", VeScaleFSDPStrategy())
        # LitGPT's pretrain spelling, as the Trainer takes it: 2 processes are 1 node x 2 devices.
        strategy = VeScaleFSDPStrategy(
            auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="HYBRID_SHARD", limit_all_gathers=True
        )
        losses, params, mesh = _trainer_fit(f"{root}/hybrid", strategy)
    assert mesh == ((1, 2), ("replicate", "shard"))
    torch.testing.assert_close(losses, want_losses, **TOL)
    assert_same_params(params, want_params, PARAM_TOL)


def test_trainer_hybrid_shard_trains_as_the_plain_run(dist_run, tmp_path):
    dist_run(_trainer_hybrid_shard_trains_as_the_plain_run, 2, str(tmp_path), timeout=240)

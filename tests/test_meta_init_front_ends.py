"""Meta-device init through every front end gives the weights of the same init run on one
process with the same seed, bit for bit, at W=2 and W=3.

The model is LitGPT-shaped and initialised as LitGPT's pretraining does (``tests.support.
litgpt_like``): built under ``init_module(empty_init=True)`` (or on ``torch.device("meta")``),
each ``nn.Linear``/``nn.Embedding``'s ``reset_parameters`` replaced by LitGPT's scaled normal
init, a head with ``trunc_normal_`` and ``xavier_uniform_`` of its own; the front end
materialises it after sharding (each rank allocates and draws only its shards). The reference
is LitGPT's single-device path: the same overrides, every module reset in module order.

FSDP2 on CPU does not give these weights (its DTensor draws each rank's shard from the rank's
own generator, so every rank draws the start of the sequence); a test below shows it, so
that the reference is known to be the one that tells engines apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from lightning.pytorch import LightningModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.data import DataLoader, TensorDataset

from accelerate_plugin import VeScaleFSDPPlugin
from lightning_strategy import VeScaleFSDPStrategy
from tests.support.accelerate_harness import accelerate_env
from tests.support.lightning_harness import launched_by_harness, make_fabric, make_trainer
from tests.support.litgpt_like import GPT, SEQ, VOCAB, initialize_weights, reset_parameters, single_process_init
from vescale_plugins import fully_shard

SEED = 1337


def _full(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix): p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _assert_single_process_init(full: dict[str, torch.Tensor]) -> None:
    reference = {name: p.detach() for name, p in single_process_init(SEED).named_parameters()}
    assert full.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(full[name], value), (
            f"{name}: max |sharded - single process| {(full[name] - value).abs().max():.3e}"
        )


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        model = GPT()
    initialize_weights(model)
    return model


# -- plain fully_shard + to_empty + reset_parameters ------------------------------------------


def _plain(shard) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = _meta_gpt()
    for block in model.h:
        shard(block)
    shard(model)
    model.to_empty(device="cpu")
    reset_parameters(model)
    return _full(model)


def _plain_like_one_process() -> None:
    _assert_single_process_init(_plain(fully_shard))


@pytest.mark.parametrize("world", [2, 3])
def test_plain_fully_shard(dist_run, world):
    dist_run(_plain_like_one_process, world)


def _fsdp2_draws_other_weights() -> None:
    full = _plain(torch_fully_shard)
    reference = single_process_init(SEED)
    assert not torch.equal(full["wte.weight"], reference.wte.weight.detach())


def test_fsdp2_on_cpu_draws_other_weights_than_one_process(dist_run):
    dist_run(_fsdp2_draws_other_weights, 2)


# -- Fabric ------------------------------------------------------------------------------------


def _fabric() -> None:
    with launched_by_harness():
        fabric = make_fabric()
        fabric.seed_everything(SEED)
        with fabric.init_module(empty_init=True):
            model = GPT()
        assert all(p.is_meta for p in model.parameters())
        initialize_weights(model)
        model = fabric.setup_module(model)
        _assert_single_process_init(_full(model.module))


@pytest.mark.parametrize("world", [2, 3])
def test_fabric(dist_run, world):
    dist_run(_fabric, world)


# -- the Lightning Trainer ---------------------------------------------------------------------


class _LitGPT(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT()
        initialize_weights(self.model)

    def setup(self, stage: str) -> None:
        torch.manual_seed(SEED)  # the generator state the strategy's materialisation starts from

    def validation_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(tokens).float().mean()


def _trainer(root: str) -> None:
    with launched_by_harness():
        trainer = make_trainer(root, strategy=VeScaleFSDPStrategy())
        with trainer.init_module(empty_init=True):
            module = _LitGPT()
        assert all(p.is_meta for p in module.parameters())
        tokens = torch.randint(0, VOCAB, (2 * dist.get_world_size(), SEQ), generator=torch.Generator().manual_seed(0))
        trainer.validate(module, DataLoader(TensorDataset(tokens), batch_size=2), verbose=False)
    _assert_single_process_init(_full(module, prefix="model."))


@pytest.mark.parametrize("world", [2, 3])
def test_lightning_trainer(dist_run, world, tmp_path):
    dist_run(_trainer, world, str(tmp_path))


# -- Accelerate --------------------------------------------------------------------------------


def _accelerate() -> None:
    with accelerate_env():
        plugin = VeScaleFSDPPlugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
        accelerator = Accelerator(fsdp_plugin=plugin)
        torch.manual_seed(SEED)
        model = accelerator.prepare(_meta_gpt())
        _assert_single_process_init(_full(model))


@pytest.mark.parametrize("world", [2, 3])
def test_accelerate(dist_run, world):
    dist_run(_accelerate, world)

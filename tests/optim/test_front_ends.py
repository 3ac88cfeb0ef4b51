"""The structure-aware optimizers through the front ends, unchanged.

Muon (hidden matrices under Muon, the rest under AdamW via ``muon_param_groups``) from a
Lightning ``configure_optimizers`` under ``strategy="vescale_fsdp"`` and through Accelerate's
``prepare(model, optimizer)`` with the plugin; AdamW8bit under the Lightning (Fabric) strategy
and the Accelerate plugin with ``block_size_fn=tile_rows(32)``. Each must end bit for bit
where a plain loop over ``vescale_plugins.fully_shard`` ends on the same batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader, DistributedSampler

from lightning_strategy import VeScaleFSDPFabricStrategy
from tests.support.accelerate_harness import accelerate_env, decoder_plugin, token_loader
from tests.support.lightning_harness import (
    LAYERS,
    LitDecoder,
    dataset,
    launched_by_harness,
    loader,
    make_fabric,
    make_trainer,
)
from tests.support.models import PER_RANK, clone, local_batch, loss_fn, make_decoder
from tests.support.parity import EXACT, assert_same_params, full_params, shard_decoder
from tests.support.uneven_params import ADAM8BIT_STATE_KEYS
from vescale_plugins.optim import AdamW8bit, Muon, muon_param_groups, tile_rows
from vescale_plugins.wrap import shard_model

ADAM8BIT_STEPS = 2


def _muon(model):
    return Muon(muon_param_groups(model, adamw_lr=1e-2, adamw_weight_decay=0.1), lr=0.02, weight_decay=0.1)


def _adamw8bit(model):
    return AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _plain_loop(initial, make_optimizer, steps, **shard_kwargs):
    """``steps`` steps of ``local_batch(step)`` on ``initial`` sharded by hand; the model and its optimizer."""
    plain = shard_decoder(clone(initial), **shard_kwargs)
    optimizer = make_optimizer(plain)
    for step in range(steps):
        tokens, targets = local_batch(step)
        loss_fn(plain(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return plain, optimizer


def _accelerate_loop(initial, make_optimizer, steps, **plugin_kwargs):
    """The same steps through Accelerate's ``prepare``; the model and its (unwrapped) optimizer."""
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin(**plugin_kwargs))
        model = clone(initial)
        model, optimizer, batches = accelerator.prepare(model, make_optimizer(model), token_loader(steps))
        for tokens, targets in batches:
            accelerator.backward(loss_fn(model(tokens), targets))
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer.optimizer


def _same_adamw8bit_runs(model, optimizer, plain, plain_optimizer):
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        for key in ADAM8BIT_STATE_KEYS:
            assert torch.equal(optimizer.state[p][key].full_tensor(), plain_optimizer.state[q][key].full_tensor()), (
                name,
                key,
            )


# ----------------------------------------------------------------------------------
# Muon
# ----------------------------------------------------------------------------------


class _LitMuonDecoder(LitDecoder):
    def configure_optimizers(self):
        return _muon(self)


def _trainer_matches_plain_loop(root):
    data = dataset(dist.get_world_size())
    with launched_by_harness():
        model = shard_model(make_decoder(seed=0, layers=LAYERS))
        optimizer = _muon(model)
        sampler = DistributedSampler(
            data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=0
        )
        for tokens, targets in DataLoader(data, batch_size=PER_RANK, sampler=sampler):
            loss_fn(model(tokens), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        want = full_params(model)

        module = _LitMuonDecoder()
        trainer = make_trainer(root)
        trainer.fit(module, loader(data))
        optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, Muon)
    assert optimizer.exchange_plan is not None
    assert_same_params(full_params(module, prefix="model."), want, EXACT)
    initial = dict(make_decoder(seed=0, layers=LAYERS).named_parameters())
    assert all(not torch.equal(want[name], initial[name]) for name in want)  # Muon and AdamW both stepped


def test_lightning_configure_optimizers_returning_muon(dist_run, tmp_path):
    dist_run(_trainer_matches_plain_loop, 2, str(tmp_path), timeout=180)


def _accelerate_with_muon_matches_plain_loop():
    steps = 3
    initial = make_decoder()
    model, optimizer = _accelerate_loop(initial, _muon, steps)
    plain, _ = _plain_loop(initial, _muon, steps)
    assert isinstance(optimizer, Muon)
    assert optimizer.exchange_plan is not None
    assert_same_params(full_params(model), full_params(plain), EXACT)


def test_accelerate_prepare_with_muon(dist_run):
    dist_run(_accelerate_with_muon_matches_plain_loop, 3, timeout=180)


# ----------------------------------------------------------------------------------
# AdamW8bit
# ----------------------------------------------------------------------------------


def _fabric_with_adamw8bit_matches_plain_loop():
    initial = make_decoder()
    with launched_by_harness():
        fabric = make_fabric(strategy=VeScaleFSDPFabricStrategy(block_size_fn=tile_rows(32)))
        model = fabric.setup_module(clone(initial))
        optimizer = fabric.setup_optimizers(_adamw8bit(model))
        for step in range(ADAM8BIT_STEPS):
            tokens, targets = local_batch(step)
            fabric.backward(loss_fn(model(tokens), targets))
            optimizer.step()
            optimizer.zero_grad()
    plain, plain_optimizer = _plain_loop(initial, _adamw8bit, ADAM8BIT_STEPS, block_size_fn=tile_rows(32))
    _same_adamw8bit_runs(model.module, optimizer.optimizer, plain, plain_optimizer)


def test_lightning_fabric_strategy_with_adamw8bit(dist_run):
    dist_run(_fabric_with_adamw8bit_matches_plain_loop, 3, timeout=180)


def _accelerate_with_adamw8bit_matches_plain_loop():
    initial = make_decoder()
    model, optimizer = _accelerate_loop(initial, _adamw8bit, ADAM8BIT_STEPS, block_size_fn=tile_rows(32))
    plain, plain_optimizer = _plain_loop(initial, _adamw8bit, ADAM8BIT_STEPS, block_size_fn=tile_rows(32))
    _same_adamw8bit_runs(model, optimizer, plain, plain_optimizer)


def test_accelerate_plugin_with_adamw8bit(dist_run):
    dist_run(_accelerate_with_adamw8bit_matches_plain_loop, 2, timeout=180)

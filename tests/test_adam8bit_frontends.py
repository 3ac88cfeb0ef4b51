"""AdamW8bit through the front ends: the Lightning (Fabric) strategy and the Accelerate plugin
train exactly what a plain ``fully_shard(..., block_size_fn=tile_rows(32))`` loop trains."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from lightning_strategy import VeScaleFSDPFabricStrategy
from models import clone, local_batch, loss_fn, make_decoder
from test_accelerate_parity import PER_RANK, accelerate_env, decoder_plugin, token_loader
from test_fully_shard import shard_decoder
from test_lightning_parity import launched_by_harness
from vescale_plugins.optim import AdamW8bit, tile_rows

STEPS = 2


def _adamw8bit(model):
    return AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _plain_loop(initial):
    plain = shard_decoder(clone(initial), block_size_fn=tile_rows(32))
    optimizer = _adamw8bit(plain)
    for step in range(STEPS):
        tokens, targets = local_batch(step, PER_RANK)
        loss_fn(plain(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return plain, optimizer


def _same(model, optimizer, plain, plain_optimizer):
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        for key in ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"):
            assert torch.equal(optimizer.state[p][key].full_tensor(), plain_optimizer.state[q][key].full_tensor()), (name, key)


def _fabric_matches_plain():
    initial = make_decoder()
    with launched_by_harness():
        fabric = Fabric(strategy=VeScaleFSDPFabricStrategy(block_size_fn=tile_rows(32)), accelerator="cpu", devices=dist.get_world_size())
        fabric.launch()
        model = fabric.setup_module(clone(initial))
        optimizer = fabric.setup_optimizers(_adamw8bit(model))
        for step in range(STEPS):
            tokens, targets = local_batch(step, PER_RANK)
            fabric.backward(loss_fn(model(tokens), targets))
            optimizer.step()
            optimizer.zero_grad()
    plain, plain_optimizer = _plain_loop(initial)
    _same(model.module, optimizer.optimizer, plain, plain_optimizer)


def test_lightning_fabric_strategy(dist_run):
    dist_run(_fabric_matches_plain, 3, timeout=180)


def _accelerate_matches_plain():
    from accelerate import Accelerator

    initial = make_decoder()
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin(block_size_fn=tile_rows(32)))
        model = clone(initial)
        model, optimizer, loader = accelerator.prepare(model, _adamw8bit(model), token_loader(STEPS))
        for tokens, targets in loader:
            accelerator.backward(loss_fn(model(tokens), targets))
            optimizer.step()
            optimizer.zero_grad()
    plain, plain_optimizer = _plain_loop(initial)
    _same(model, optimizer.optimizer, plain, plain_optimizer)


def test_accelerate_plugin(dist_run):
    dist_run(_accelerate_matches_plain, 2, timeout=180)

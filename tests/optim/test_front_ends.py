"""Muon through the front ends, unchanged: a Lightning ``configure_optimizers`` under
``strategy="vescale_fsdp"``, and Accelerate's ``prepare(model, optimizer)`` with the plugin.

Each trains the test decoder with one Muon optimizer (hidden matrices under Muon, the rest
under AdamW via ``muon_param_groups``) and must end bit-for-bit where a plain loop over
``vescale_plugins.fully_shard`` ends on the same batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader, DistributedSampler

from models import clone, loss_fn, make_decoder
from test_accelerate_parity import accelerate_env, decoder_plugin, token_loader
from test_fully_shard import shard_decoder
from test_lightning_parity import EXACT, LAYERS, PER_RANK, LitDecoder, assert_same_params, dataset, full_params, launched_by_harness, loader, make_trainer
from vescale_plugins.optim import Muon
from vescale_plugins.optim import muon_param_groups
from vescale_plugins.wrap import shard_model


def _muon(model):
    return Muon(muon_param_groups(model, adamw_lr=1e-2, adamw_weight_decay=0.1), lr=0.02, weight_decay=0.1)


class _LitMuonDecoder(LitDecoder):
    def configure_optimizers(self):
        return _muon(self)


def _trainer_matches_plain_loop(root):
    data = dataset(dist.get_world_size())
    with launched_by_harness():
        model = shard_model(make_decoder(seed=0, layers=LAYERS))
        optimizer = _muon(model)
        sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=0)
        for tokens, targets in DataLoader(data, batch_size=PER_RANK, sampler=sampler):
            loss_fn(model(tokens), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        want = full_params(model)

        module = _LitMuonDecoder()
        trainer = make_trainer(root)
        trainer.fit(module, loader(data))
        optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, Muon) and optimizer.exchange_plan is not None
    assert_same_params(full_params(module, prefix="model."), want, EXACT)
    initial = dict(make_decoder(seed=0, layers=LAYERS).named_parameters())
    assert all(not torch.equal(want[name], initial[name]) for name in want)  # Muon and AdamW both stepped


def test_lightning_configure_optimizers_returning_muon(dist_run, tmp_path):
    dist_run(_trainer_matches_plain_loop, 2, str(tmp_path), timeout=180)


def _accelerate_matches_plain_loop():
    steps = 3
    initial = make_decoder()
    plain = shard_decoder(clone(initial))
    plain_opt = _muon(plain)
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin())
        model = clone(initial)
        model, optimizer, batches = accelerator.prepare(model, _muon(model), token_loader(steps))
        for tokens, targets in batches:
            accelerator.backward(loss_fn(model(tokens), targets))
            optimizer.step()
            optimizer.zero_grad()
            loss_fn(plain(tokens), targets).backward()
            plain_opt.step()
            plain_opt.zero_grad()
        inner = optimizer.optimizer
        assert isinstance(inner, Muon) and inner.exchange_plan is not None
        assert_same_params({n: p.full_tensor() for n, p in model.named_parameters()}, {n: p.full_tensor() for n, p in plain.named_parameters()}, EXACT)


def test_accelerate_prepare_with_muon(dist_run):
    dist_run(_accelerate_matches_plain_loop, 3, timeout=180)

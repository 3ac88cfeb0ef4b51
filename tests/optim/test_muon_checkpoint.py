"""Muon's state through DCP: save at W=2, load at W=3, continue exactly as an uninterrupted run.

The model is sharded by ``vescale_plugins.fully_shard``; Muon steps its hidden matrices and
AdamW (a group of the same optimizer) the rest. Gradients are given (the same full gradient
on every rank, each rank taking its shard), so the uninterrupted unsharded run is the exact
reference and the only thing under test is the optimizer and its checkpoint.
"""

import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from vescale_plugins import RaggedShard, fully_shard
from vescale_plugins.optim import Muon, muon_param_groups

SAVE_AT, TOTAL_STEPS, SAVE_WORLD, LOAD_WORLD = 2, 4, 2, 3


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 42)
        self.up = nn.Linear(42, 97, bias=False)
        self.down = nn.Linear(97, 42)
        self.thin = nn.Linear(42, 2, bias=False)  # fewer rows than ranks
        self.norm = nn.LayerNorm(42)


def _make(seed=0):
    torch.manual_seed(seed)
    return _Net()


def _grad(name, shape, step):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    return torch.randn(shape, generator=g)


def _step(model, opt, step):
    for name, p in model.named_parameters():
        full = _grad(name, tuple(p.shape), step)
        if isinstance(p, DTensor):
            local = p.placements[0].split_full(full, dist.get_rank()).clone()
            full = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        p.grad = full
    opt.step()
    opt.zero_grad()


def _optimizer(model):
    return Muon(muon_param_groups(model, adamw_lr=1e-2, adamw_weight_decay=0.05), lr=0.02, weight_decay=0.1)


def _sharded(seed):
    model = _make(seed)
    fully_shard(model.up)
    fully_shard(model)
    return model


def _save(path):
    model = _sharded(seed=0)
    opt = _optimizer(model)
    for step in range(SAVE_AT):
        _step(model, opt, step)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    momentum = [v["momentum_buffer"] for v in opt.state.values() if "momentum_buffer" in v]
    assert momentum
    assert all(isinstance(m, DTensor) and isinstance(m.placements[0], RaggedShard) for m in momentum)
    dcp.save(state, checkpoint_id=path)


def _load_and_continue(path):
    model = _sharded(seed=99)  # loaded over: its own values must not matter
    opt = _optimizer(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    assert opt.exchange_plan.world_size == LOAD_WORLD  # roots recomputed for the new group
    for step in range(SAVE_AT, TOTAL_STEPS):
        _step(model, opt, step)
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def test_save_at_two_ranks_load_at_three_continues_exactly(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    dist_run(_save, SAVE_WORLD, path)
    got = dist_run(_load_and_continue, LOAD_WORLD, path)[0]
    reference = _make()
    opt = _optimizer(reference)
    for step in range(TOTAL_STEPS):
        _step(reference, opt, step)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")

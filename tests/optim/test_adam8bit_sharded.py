"""AdamW8bit on RaggedShard parameters: the sharded step equals the unsharded one (codes,
scales, parameters), checkpoints reshard bit-exactly, misaligned shards are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from tests.support.uneven_params import ADAM8BIT_STATE_KEYS, SHAPES, UnevenParams, coefficients
from vescale_plugins import fully_shard
from vescale_plugins.optim import AdamW8bit, tile_rows
from vescale_plugins.optim.flat import contiguous_runs


def _train(model, opt, steps, sharded: bool):
    for step in steps:
        coeffs = coefficients(step)
        if sharded and dist.get_rank() != 0:
            # Only rank 0 contributes, and the divide factor is 1: the reduced gradient is
            # exactly the unsharded one (a sum of W equal values, divided by W, may round).
            coeffs = {n: torch.zeros_like(c) for n, c in coeffs.items()}
            model(coeffs).mul(0.0).backward()
        else:
            model(coeffs).backward()
        if sharded:
            # The unit's parameters are stepped as flat runs of its DBuffer, not one by one.
            held = [p for p in model.parameters() if p.to_local().numel()]
            assert len(held) <= 1 or len(contiguous_runs(held)) < len(held)
        opt.step()
        opt.zero_grad()


def _sharded_model(seed: int = 0) -> nn.Module:
    model = fully_shard(UnevenParams(seed), block_size_fn=tile_rows(32))
    model.set_gradient_divide_factor(1.0)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _sharded_equals_unsharded(steps: int):
    reference = UnevenParams()
    ref_opt = AdamW8bit(reference.parameters(), lr=1e-2, weight_decay=0.1)
    _train(reference, ref_opt, range(steps), sharded=False)
    model = _sharded_model()
    opt = AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, range(steps), sharded=True)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        full = p.full_tensor()
        assert torch.equal(full, ref.detach()), (name, (full - ref).abs().max())
        for key in ADAM8BIT_STATE_KEYS:
            ours, theirs = _full(opt.state[p][key]), ref_opt.state[ref][key]
            assert ours.dtype == theirs.dtype, (name, key)
            assert ours.shape == theirs.shape, (name, key)
            assert torch.equal(ours, theirs), (name, key)
        # Tiles are whole on every rank: the shard starts on a tile row (or 1024-element block).
        start = sum(s.length for s in p.placements[0].layout(p.shape).slices[: dist.get_rank()])
        unit = 32 * (p.numel() // p.shape[0]) if p.dim() >= 2 else 1024
        assert p.dim() == 0 or p.to_local().numel() == 0 or start % unit == 0
    state_bytes = opt.state_bytes()
    return state_bytes


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_sharded_step_equals_the_unsharded_step(dist_run, world):
    dist_run(_sharded_equals_unsharded, world, 2, timeout=120)


def _save(path):
    model = _sharded_model()
    opt = AdamW8bit(model.parameters(), lr=1e-2)
    _train(model, opt, range(2), sharded=True)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return {n: {k: _full(opt.state[p][k]) for k in ADAM8BIT_STATE_KEYS} for n, p in model.named_parameters()}


def _load(path, save_again_to=None):
    model = _sharded_model(seed=5)
    opt = AdamW8bit(model.parameters(), lr=1e-2)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])
    if save_again_to is not None:
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=save_again_to)
    loaded = {n: {k: _full(opt.state[p][k]) for k in ADAM8BIT_STATE_KEYS} for n, p in model.named_parameters()}
    for p in model.parameters():
        assert opt.state[p]["exp_avg_codes"].dtype == torch.uint8
    # The loaded state steps (it was packed back into flat buffers).
    _train(model, opt, range(2, 3), sharded=True)
    return loaded


def _load_single_process(path):
    model = UnevenParams(seed=5)
    opt = AdamW8bit(model.parameters(), lr=1e-2)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_optimizer_state_dict(model, opt, state["optim"])
    return {n: {k: opt.state[p][k].clone() for k in ADAM8BIT_STATE_KEYS} for n, p in model.named_parameters()}


def test_checkpoint_reshards_bit_exactly_two_three_one(dist_run, tmp_path):
    first, second = str(tmp_path / "w2"), str(tmp_path / "w3")
    saved = dist_run(_save, 2, first, timeout=120)[0]
    at_three = dist_run(_load, 3, first, second, timeout=120)
    at_one = _load_single_process(second)
    for name in SHAPES:
        for key in ADAM8BIT_STATE_KEYS:
            assert torch.equal(at_three[0][name][key], saved[name][key]), (name, key)
            assert torch.equal(at_one[name][key], saved[name][key]), (name, key)
            assert saved[name][key].dtype == (torch.uint8 if key.endswith("codes") else torch.float32)


def _full_state_dict_is_the_unsharded_state():
    reference = UnevenParams()
    ref_opt = AdamW8bit(reference.parameters(), lr=1e-2)
    _train(reference, ref_opt, range(2), sharded=False)
    model = _sharded_model()
    opt = AdamW8bit(model.parameters(), lr=1e-2)
    _train(model, opt, range(2), sharded=True)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for name, ref in zip(SHAPES, reference.parameters()):
        for key in ADAM8BIT_STATE_KEYS:
            assert torch.equal(full["state"][name][key], ref_opt.state[ref][key]), (name, key)


def test_full_state_dict(dist_run):
    dist_run(_full_state_dict_is_the_unsharded_state, 3, timeout=120)


def _misaligned_is_refused():
    model = fully_shard(UnevenParams())  # one-row blocks: tiles cut by rank boundaries
    with pytest.raises(
        ValueError, match=r"AdamW8bit: 'a' \(shape \(1031, 40\).*block_size_fn=vescale_plugins.optim.tile_rows\(32\)"
    ):
        AdamW8bit(model.named_parameters())


def test_misaligned_shards_are_refused_naming_the_fix(dist_run):
    dist_run(_misaligned_is_refused, 3, timeout=60)


def test_amsgrad_is_refused():
    with pytest.raises(ValueError, match=r"AdamW8bit\(amsgrad=True\) is not supported"):
        AdamW8bit([nn.Parameter(torch.zeros(3))], amsgrad=True)

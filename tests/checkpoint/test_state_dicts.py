"""Checkpoints of fully_shard models: sharded DCP across world sizes, FSDP2 <-> veScale, full.

A run trains at W=2, saves, and another run loads at W=3 and continues; the losses and the
final parameters must equal an uninterrupted unsharded run that saw the same batches.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from tests.support.models import make_decoder, reference_step
from tests.support.parity import PARAM_TOL, TOL, adamw, shard_decoder, sharded_step
from vescale_plugins import RaggedShard, fully_shard
from vescale_plugins.checkpoint import load_full_model_state_dict

ENGINES = {"vescale": fully_shard, "fsdp2": torch_fully_shard}
SAVE_AT, SAVE_WORLD, LOAD_WORLD, TOTAL_STEPS = 2, 2, 3, 4


def _train(model, opt, steps):
    losses = []
    for step in steps:
        losses.append(sharded_step(model, step))
        opt.step()
        opt.zero_grad()
    return losses


def _train_and_save(path, engine):
    model = shard_decoder(make_decoder(), shard=ENGINES[engine])
    opt = adamw(model)
    losses = _train(model, opt, range(SAVE_AT))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return [x.item() for x in losses]


def _load_and_continue(path, engine):
    model = shard_decoder(make_decoder(seed=99), shard=ENGINES[engine])
    opt = adamw(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    losses = _train(model, opt, range(SAVE_AT, TOTAL_STEPS))
    return [x.item() for x in losses], {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def _uninterrupted_reference():
    reference = make_decoder()
    opt = adamw(reference)
    losses = []
    for step in range(TOTAL_STEPS):
        losses.append(reference_step(reference, step, SAVE_WORLD if step < SAVE_AT else LOAD_WORLD).item())
        opt.step()
        opt.zero_grad()
    return losses, dict(reference.named_parameters())


@pytest.mark.parametrize(("saver", "loader"), [("vescale", "vescale"), ("fsdp2", "vescale"), ("vescale", "fsdp2")])
def test_save_at_two_ranks_load_at_three_and_continue(dist_run, tmp_path, saver, loader):
    path = str(tmp_path / "ckpt")
    first = dist_run(_train_and_save, SAVE_WORLD, path, saver)[0]
    later, params = dist_run(_load_and_continue, LOAD_WORLD, path, loader)[0]
    want_losses, want_params = _uninterrupted_reference()
    torch.testing.assert_close(torch.tensor(first + later), torch.tensor(want_losses), **TOL)
    for name, value in params.items():
        torch.testing.assert_close(value, want_params[name].detach(), **PARAM_TOL, msg=lambda m: f"{name}: {m}")


def _state_dicts_keep_names_and_round_trip():
    reference = make_decoder()
    model = shard_decoder(make_decoder())
    sharded = model.state_dict()
    assert list(sharded) == list(reference.state_dict())
    for name, value in sharded.items():
        if name == "position_scale":
            assert not isinstance(value, DTensor)
            continue
        assert isinstance(value, DTensor), name
        assert isinstance(value.placements[0], RaggedShard), name

    # full state dict (what a plain model loads) and back into a sharded model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = make_decoder(seed=5)
    plain.load_state_dict(full)
    for (name, p), (_, q) in zip(plain.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name

    other = shard_decoder(make_decoder(seed=5))
    set_model_state_dict(other, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    for (name, p), (_, q) in zip(other.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.full_tensor(), q), name

    # nn.Module.load_state_dict with the sharded state dict of another model
    third = shard_decoder(make_decoder(seed=6))
    third.load_state_dict(model.state_dict())
    for (name, p), (_, q) in zip(third.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.full_tensor(), q), name
        unit_buffer = p._local_tensor.untyped_storage().data_ptr()
        assert any(
            unit_buffer == b.sharded.untyped_storage().data_ptr()
            for m in third.modules()
            if hasattr(m, "_vescale_fsdp_unit")
            for b in m._vescale_fsdp_unit.dbuffers
        ), name


@pytest.mark.parametrize("world", [2, 3])
def test_state_dicts_keep_names_full_and_sharded(dist_run, world):
    dist_run(_state_dicts_keep_names_and_round_trip, world)


class _RenamesOnLoad(torch.nn.Module):
    """Takes an older checkpoint's ``proj.weight`` as ``proj.linear.weight`` (LitGPT's LoRA models do)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Module()
        self.proj.linear = torch.nn.Linear(6, 10, bias=False)

    def forward(self, x):
        return self.proj.linear(x)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "proj.weight" in state_dict:
            state_dict[prefix + "proj.linear.weight"] = state_dict.pop(prefix + "proj.weight")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _full_load_through_renaming_hooks():
    torch.manual_seed(0)
    plain = _RenamesOnLoad()
    old_names = {"proj.weight": plain.proj.linear.weight.detach().clone()}
    model = fully_shard(_RenamesOnLoad())
    load_full_model_state_dict(model, old_names)
    torch.testing.assert_close(model.proj.linear.weight.full_tensor(), old_names["proj.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_full_load_takes_keys_the_models_load_hooks_rename(dist_run, world):
    """As an unsharded model (and FSDP1's full-state-dict load) takes them; torch's
    ``set_model_state_dict`` alone shards only the keys the model's state dict has."""
    dist_run(_full_load_through_renaming_hooks, world)

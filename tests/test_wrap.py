"""The core helpers the adapters share: unit selection and checkpoint save/load."""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from tests.support.models import Block, Decoder, make_decoder, reference_step
from tests.support.parity import adamw, assert_matches, sharded_step
from vescale_plugins.checkpoint import full_model_state_dict, load_full_model_state_dict, load_sharded, save_sharded
from vescale_plugins.wrap import default_units, is_sharded, shard_model, units_of_classes


def test_default_units_are_the_blocks_of_module_lists():
    model = make_decoder()
    assert default_units(model) == list(model.layers)
    assert units_of_classes(model, ["Block"]) == list(model.layers)
    assert units_of_classes(model, [Block]) == list(model.layers)
    assert units_of_classes(model, [Decoder, Block]) == list(model.layers)  # the root itself is never a unit


def _shard_model_then_checkpoint(path):
    world = dist.get_world_size()
    reference = make_decoder()
    model = shard_model(make_decoder())
    assert is_sharded(model)
    assert all(getattr(b, "_vescale_fsdp_unit", None) is not None for b in model.layers)
    assert shard_model(model) is model  # idempotent: an already sharded model is left alone
    opt, ref_opt = adamw(model), adamw(reference)
    reference_step(reference, 0, world)
    sharded_step(model, 0)
    opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    save_sharded(path, model, opt, extra={"step": torch.tensor(1)})

    full = full_model_state_dict(model)
    gathered = {name: p.full_tensor() for name, p in model.named_parameters()}  # collective: every rank
    if dist.get_rank() == 0:
        plain = make_decoder(seed=3)
        plain.load_state_dict(full)
        for name, p in plain.named_parameters():
            assert torch.equal(p, gathered[name]), name
    else:
        assert full == {}

    other = shard_model(make_decoder(seed=4))
    load_full_model_state_dict(other, reference.state_dict())
    assert_matches(other, reference, "param")

    # Only rank 0 holds the full weights; torch broadcasts and each rank keeps its row box.
    broadcast = shard_model(make_decoder(seed=6))
    set_model_state_dict(
        broadcast,
        reference.state_dict() if dist.get_rank() == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    assert_matches(broadcast, reference, "param")

    resumed = shard_model(make_decoder(seed=5))
    resumed_opt = adamw(resumed)
    extra = load_sharded(path, resumed, resumed_opt, extra={"step": torch.tensor(0)})
    assert extra["step"].item() == 1
    for m, r in ((model, reference), (resumed, reference)):
        assert_matches(m, r, "param")
    reference_step(reference, 1, world)
    sharded_step(resumed, 1)
    resumed_opt.step(), ref_opt.step()
    assert_matches(resumed, reference, "param")


def test_shard_model_and_checkpoint_helpers(dist_run, tmp_path):
    dist_run(_shard_model_then_checkpoint, 3, str(tmp_path / "ckpt"))

"""Accelerate checkpoints of veScale-FSDP models: resume, another world size, plain models.

``save_state``/``load_state`` go through Accelerate's own ``save/load_fsdp_model/optimizer``
(sharded DCP directories or rank-0 full files, FSDP2's layout); ``get_state_dict`` and
``save_model`` give full weights a plain, unsharded model loads.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import merge_fsdp_weights
from safetensors.torch import load_file

from tests.support.accelerate_harness import MAX_GRAD_NORM, accelerate_env, decaying_lr, decoder_plugin, token_loader
from tests.support.models import loss_fn, make_decoder
from tests.support.parity import EXACT, adamw, assert_same_params, full_params
from vescale_plugins.checkpoint import full_optimizer_state_dict

TOTAL_STEPS, SAVE_AT = 5, 2


def _prepared(state_dict_type: str, seed: int, steps: int = TOTAL_STEPS) -> tuple:
    accelerator = Accelerator(fsdp_plugin=decoder_plugin(state_dict_type=state_dict_type))
    model = make_decoder(seed=seed)
    optimizer = adamw(model)
    prepared = accelerator.prepare(model, optimizer, token_loader(steps), decaying_lr(optimizer))
    return (accelerator, *prepared)


def _train(accelerator, model, optimizer, batches, lr) -> list[torch.Tensor]:
    losses = []
    for tokens, targets in batches:
        loss = loss_fn(model(tokens), targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        lr.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _take(loader, count: int) -> list:
    batches = []
    for item in loader:
        if len(batches) == count:
            break
        batches.append(item)
    return batches


def _resume_continues_identically(path: str, state_dict_type: str) -> None:
    with accelerate_env():
        accelerator, model, optimizer, loader, lr = _prepared(state_dict_type, seed=0)
        batches = list(loader)
        _train(accelerator, model, optimizer, batches[:SAVE_AT], lr)
        accelerator.save_state(path)
        saved = full_params(model)
        want_losses = _train(accelerator, model, optimizer, batches[SAVE_AT:], lr)
        want = full_params(model)

    with accelerate_env():
        accelerator, model, optimizer, loader, lr = _prepared(state_dict_type, seed=7)
        accelerator.load_state(path)
        assert_same_params(full_params(model), saved, EXACT)
        got_losses = _train(accelerator, model, optimizer, list(accelerator.skip_first_batches(loader, SAVE_AT)), lr)
        torch.testing.assert_close(torch.stack(got_losses), torch.stack(want_losses), **EXACT)
        assert_same_params(full_params(model), want, EXACT)

        # The model part of the checkpoint is an ordinary state dict for an unsharded model.
        model_dir = os.path.join(path, "pytorch_model_fsdp_0")
        if state_dict_type == "SHARDED_STATE_DICT":
            merge_fsdp_weights(model_dir, os.path.join(path, "merged"), safe_serialization=False)
            model_file = os.path.join(path, "merged", "pytorch_model.bin")
        else:
            model_file = os.path.join(path, "pytorch_model_fsdp.bin")
        if dist.get_rank() == 0:
            plain = make_decoder(seed=9)
            plain.load_state_dict(torch.load(model_file, weights_only=True))
            assert_same_params({n: p.detach() for n, p in plain.named_parameters()}, saved, EXACT)


@pytest.mark.parametrize(("state_dict_type", "world"), [("SHARDED_STATE_DICT", 3), ("FULL_STATE_DICT", 2)])
def test_save_state_load_state_resume_continues_identically(dist_run, tmp_path, state_dict_type, world):
    dist_run(_resume_continues_identically, world, str(tmp_path / "state"), state_dict_type)


def _save_state(path: str, state_dict_type: str) -> None:
    with accelerate_env():
        accelerator, model, optimizer, loader, lr = _prepared(state_dict_type, seed=0)
        _train(accelerator, model, optimizer, _take(loader, SAVE_AT), lr)
        accelerator.save_state(path)
        expected = {"params": full_params(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
        if dist.get_rank() == 0:
            torch.save(expected, os.path.join(path, "expected.pt"))


def _load_state(path: str, state_dict_type: str) -> None:
    with accelerate_env():
        accelerator, model, optimizer, loader, lr = _prepared(state_dict_type, seed=7)
        accelerator.load_state(path)
        expected = torch.load(os.path.join(path, "expected.pt"), weights_only=True)
        assert_same_params(full_params(model), expected["params"], EXACT)
        loaded = full_optimizer_state_dict(model, optimizer)
        if dist.get_rank() == 0:
            assert loaded["state"].keys() == expected["optimizer"]["state"].keys()
            for name, state in expected["optimizer"]["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(
                        loaded["state"][name][key], value, **EXACT, msg=lambda m: f"{name}.{key}: {m}"
                    )
        assert lr.scheduler.last_epoch == SAVE_AT * 2  # saved at 2 ranks: Accelerate steps it twice per step
        # It trains on at the new world size.
        _train(accelerator, model, optimizer, _take(loader, 1), lr)


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_state_saved_at_two_ranks_loads_at_three(dist_run, tmp_path, state_dict_type):
    path = str(tmp_path / "state")
    dist_run(_save_state, 2, path, state_dict_type)
    dist_run(_load_state, 3, path, state_dict_type)


def _full_weights_for_a_plain_model(path: str) -> None:
    with accelerate_env():
        accelerator, model, optimizer, loader, lr = _prepared("SHARDED_STATE_DICT", seed=0)
        _train(accelerator, model, optimizer, _take(loader, 1), lr)
        trained = full_params(model)
        state_dict = accelerator.get_state_dict(model)
        accelerator.save_model(model, path)
        if dist.get_rank() != 0:
            assert state_dict == {}
            return
        plain = make_decoder(seed=9)
        plain.load_state_dict(state_dict)
        assert_same_params({n: p.detach() for n, p in plain.named_parameters()}, trained, EXACT)

        plain = make_decoder(seed=9)
        missing, unexpected = plain.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
        # safetensors stores a tied weight once; the plain model re-ties it on load.
        assert unexpected == [], (missing, unexpected)
        assert set(missing) <= {"head.weight", "embed.weight"}, (missing, unexpected)
        assert_same_params({n: p.detach() for n, p in plain.named_parameters()}, trained, EXACT)


def test_get_state_dict_and_save_model_give_full_weights(dist_run, tmp_path):
    dist_run(_full_weights_for_a_plain_model, 3, str(tmp_path / "model"))


def _rank0_weights_reach_every_rank() -> None:
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin(cpu_ram_efficient_loading=True))
        # transformers loads real weights on rank 0 only and leaves the others uninitialised.
        model = make_decoder(seed=0 if dist.get_rank() == 0 else 5)
        optimizer = adamw(model)
        model, optimizer, lr = accelerator.prepare(model, optimizer, decaying_lr(optimizer))
        want = {name: p.detach() for name, p in make_decoder(seed=0).named_parameters()}
        assert_same_params(full_params(model), want, EXACT)
        _train(accelerator, model, optimizer, token_loader(1), lr)  # the loaded shards train


def test_cpu_ram_efficient_loading_gives_every_rank_the_weights_of_rank0(dist_run):
    dist_run(_rank0_weights_reach_every_rank, 3)


def _mismatched_full_state_fails_on_every_rank() -> str:
    from accelerate_plugin.full_state import load_model_from_rank0

    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin())
        model = make_decoder()
        model, _ = accelerator.prepare(model, adamw(model))
        rank0_state = {"not_a_parameter": torch.zeros(1)} if dist.get_rank() == 0 else {}
        with pytest.raises(KeyError) as error:
            load_model_from_rank0(model, rank0_state)
        return str(error.value)


def test_a_mismatched_full_state_fails_on_every_rank_instead_of_hanging(dist_run):
    for message in dist_run(_mismatched_full_state_fails_on_every_rank, 2, timeout=60):
        assert "unexpected ['not_a_parameter']" in message
        assert "embed.weight" in message

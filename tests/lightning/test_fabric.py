"""The Fabric strategy: setup_module + setup_optimizers, init_module(empty_init=True), save / load.

A run at W=2 trains two steps, saves a sharded and a full checkpoint, and trains two more (the
reference). Runs at W=3 and W=2 build the model on the meta device, load either checkpoint
and continue: same losses. The global batch is the same 6 samples at every world size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_strategy import VeScaleFSDPFabricStrategy
from tests.support.lightning_harness import LAYERS, Tokens, launched_by_harness, make_fabric
from tests.support.models import Block, loss_fn, make_decoder
from tests.support.parity import EXACT, PARAM_TOL, TOL, adamw, assert_same_params, full_params
from vescale_plugins.checkpoint import MODEL_KEY

GLOBAL_BATCH, SAVE_AT, TOTAL_STEPS = 6, 2, 4
DATA = Tokens(GLOBAL_BATCH * TOTAL_STEPS)


def _step(fabric, model, optimizer, step: int) -> float:
    per_rank = GLOBAL_BATCH // fabric.world_size
    first = step * GLOBAL_BATCH + fabric.global_rank * per_rank
    tokens, targets = DATA[first : first + per_rank]
    loss = loss_fn(model(tokens), targets)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return fabric.all_reduce(loss.detach(), reduce_op="mean").item()


def _train_save_continue(root):
    with launched_by_harness():
        fabric = make_fabric()  # sharded checkpoints by default
        model = fabric.setup_module(make_decoder(layers=LAYERS))
        optimizer = fabric.setup_optimizers(adamw(model))  # built after setup, over the sharded parameters
        losses = [_step(fabric, model, optimizer, step) for step in range(SAVE_AT)]
        state = {"model": model, "optimizer": optimizer, "step": SAVE_AT}
        fabric.save(f"{root}/sharded", state)
        full_writer = Fabric(
            strategy=VeScaleFSDPFabricStrategy(state_dict_type="full"), accelerator="cpu", devices=fabric.world_size
        )
        full_writer.launch()
        full_writer.save(f"{root}/full.ckpt", state)
        with pytest.raises(IsADirectoryError, match="it is a directory"):  # rank 0 fails to write: every rank raises
            full_writer.save(root, state)
        losses += [_step(fabric, model, optimizer, step) for step in range(SAVE_AT, TOTAL_STEPS)]
    return losses


def _load_and_continue(root, checkpoint):
    with launched_by_harness():
        fabric = make_fabric()
        with fabric.init_module(empty_init=True):
            model = make_decoder(layers=LAYERS)
        assert all(p.is_meta for p in model.parameters())
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(adamw(model))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        assert fabric.load(f"{root}/{checkpoint}", state) == {}
        assert state["step"] == SAVE_AT
        losses = [_step(fabric, model, optimizer, step) for step in range(SAVE_AT, TOTAL_STEPS)]

        plain = fabric.setup_module(make_decoder(seed=3, layers=LAYERS))
        fabric.load_raw(f"{root}/plain.pt", plain)  # a plain model's state dict loads into a sharded one
        assert_same_params(
            full_params(plain.module),
            {n: p.detach() for n, p in make_decoder(seed=4, layers=LAYERS).named_parameters()},
            EXACT,
        )
    return losses


def test_save_and_load_sharded_and_full_at_another_world_size(dist_run, tmp_path):
    root = str(tmp_path)
    torch.save(make_decoder(seed=4, layers=LAYERS).state_dict(), tmp_path / "plain.pt")
    reference = dist_run(_train_save_continue, 2, root, timeout=180)[0]
    for checkpoint in ("sharded", "full.ckpt"):
        for world in (3, 2):
            later = dist_run(_load_and_continue, world, root, checkpoint)[0]
            tol = EXACT if world == 2 else TOL
            torch.testing.assert_close(
                torch.tensor(later),
                torch.tensor(reference[SAVE_AT:]),
                **tol,
                msg=lambda m: f"{checkpoint} at W={world}: {m}",
            )

    # The full file loads into a plain, unsharded model and holds what the shards hold.
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert full["step"] == SAVE_AT
    assert set(full) == {"model", "optimizer", "step"}
    plain = make_decoder(layers=LAYERS)
    plain.load_state_dict(full["model"])
    dcp_to_torch_save(tmp_path / "sharded", tmp_path / "converted.pt")
    from_shards = torch.load(tmp_path / "converted.pt", weights_only=False)[MODEL_KEY]
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), from_shards[name], **PARAM_TOL, msg=lambda m: f"{name}: {m}")
    assert torch.load(Path(tmp_path, "sharded", "meta.pt"), weights_only=False) == {"step": SAVE_AT}


def _sharding_options_reach_fully_shard():
    with launched_by_harness():
        strategy = VeScaleFSDPFabricStrategy(
            auto_wrap_policy={Block},
            reshard_after_forward=False,
            block_size_fn=lambda name, p: 36 if name.endswith("qkv.weight") else None,
            cpu_offload=True,
        )
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=dist.get_world_size())
        fabric.launch()
        model = fabric.setup_module(make_decoder(layers=LAYERS)).module
    units = [name for name, m in model.named_modules() if getattr(m, "_vescale_fsdp_unit", None) is not None]
    assert units == ["", "layers.0", "layers.1"]
    assert all(model.get_submodule(name)._vescale_fsdp_unit.reshard_after_forward is False for name in units)
    assert all(model.get_submodule(name)._vescale_fsdp_unit.offload == CPUOffloadPolicy() for name in units)
    for block in model.layers:
        assert block.attn.qkv.weight.to_local().shape[0] % 36 == 0  # whole 36-row blocks on each rank


def test_wrap_policy_and_fully_shard_arguments_reach_the_core(dist_run):
    dist_run(_sharding_options_reach_fully_shard, 3)

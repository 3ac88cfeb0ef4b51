"""The Trainer strategy beyond the training step: evaluation loops, meta init, user sharding, checkpoints.

Checkpoints: an uninterrupted two-epoch run at W=2 is the reference; runs that resume from its
end-of-epoch-0 checkpoint (sharded and full, saved by ModelCheckpoint) must continue with the
same losses at W=2 and at W=3. The global batch is 6 in both (3 per rank at W=2, 2 at W=3)
and Lightning's DistributedSampler permutes independently of the world size, so every step
sees the same samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_strategy import VeScaleFSDPStrategy
from tests.support.lightning_harness import LitDecoder, Tokens, dataset, launched_by_harness, loader, make_trainer
from tests.support.models import loss_fn, make_decoder
from tests.support.parity import EXACT, PARAM_TOL, TOL, assert_same_params, full_params
from vescale_plugins import fully_shard
from vescale_plugins.checkpoint import MODEL_KEY

GLOBAL_BATCH = 6
STEPS_PER_EPOCH = 3


def _all_sharded(module: torch.nn.Module) -> bool:
    return all(isinstance(p, DTensor) for p in module.parameters())


# ----------------------------------------------------------------------------------
# evaluation loops, sync_dist, predict
# ----------------------------------------------------------------------------------


def _plain_eval_losses(params: dict, data: Tokens) -> list[float]:
    """Each global validation batch's mean loss, computed by an unsharded model with ``params``."""
    plain = make_decoder(layers=2)
    plain.load_state_dict(params, strict=False)  # the tied head is the embedding
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False)
    losses = []
    with torch.no_grad():
        for tokens, targets in DataLoader(data, batch_size=2, sampler=sampler):
            loss = loss_fn(plain(tokens), targets)
            dist.all_reduce(loss)
            losses.append(loss.item() / dist.get_world_size())
    return losses


def _fit_validate_test_predict(root):
    world = dist.get_world_size()
    train, val = dataset(world), Tokens(4 * world, seed=1)
    module = LitDecoder()
    with launched_by_harness():
        trainer = make_trainer(root)
        trainer.fit(module, loader(train), DataLoader(val, batch_size=2))
        assert _all_sharded(module), "the root's parameters stayed gathered after validation"
        assert trainer.callback_metrics["train_loss"].item() == pytest.approx(module.global_losses[-1], rel=1e-6)

        params = full_params(module, prefix="model.")
        want = sum(_plain_eval_losses(params, val)) / 2  # two validation batches per rank
        (validated,) = trainer.validate(module, DataLoader(val, batch_size=2))
        (tested,) = trainer.test(module, DataLoader(val, batch_size=2))
        predictions = trainer.predict(module, DataLoader(val, batch_size=2))
        assert _all_sharded(module)
    assert validated["val_loss"] == pytest.approx(want, rel=1e-5)
    assert tested["test_loss"] == pytest.approx(want, rel=1e-5)
    plain = make_decoder(layers=2)
    plain.load_state_dict(params, strict=False)
    rank_rows = list(DistributedSampler(val, num_replicas=world, rank=dist.get_rank(), shuffle=False))
    assert torch.equal(torch.cat(predictions), plain(val.data[rank_rows, :-1]).argmax(-1))


def test_validate_test_predict_and_sync_dist(dist_run, tmp_path):
    dist_run(_fit_validate_test_predict, 2, str(tmp_path), timeout=180)


# ----------------------------------------------------------------------------------
# meta-device init, a model the user sharded in configure_model, a bad wrap policy
# ----------------------------------------------------------------------------------


class _SeededBeforeSetup(LitDecoder):
    def setup(self, stage):
        torch.manual_seed(5)  # the RNG state the strategy's reset_parameters() calls start from


def _reset_like_lightning(model: torch.nn.Module) -> None:
    """Lightning's materialisation rule, on an eager model: reset every module holding tensors, parents first."""
    for module in model.modules():
        holds = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if holds and hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _meta_init_materialises_after_sharding(root):
    with launched_by_harness():
        trainer = make_trainer(root, strategy=VeScaleFSDPStrategy())
        with trainer.init_module(empty_init=True):
            module = _SeededBeforeSetup()
        assert all(p.is_meta for p in module.parameters())
        trainer.validate(module, DataLoader(Tokens(4), batch_size=2), verbose=False)
    assert _all_sharded(module)
    assert not any(p.is_meta for p in module.parameters())
    eager = make_decoder(layers=2)
    torch.manual_seed(5)
    _reset_like_lightning(eager)
    assert_same_params(
        full_params(module, prefix="model."), {n: p.detach() for n, p in eager.named_parameters()}, EXACT
    )


def test_init_module_empty_init_builds_on_meta_and_setup_materialises(dist_run, tmp_path):
    dist_run(_meta_init_materialises_after_sharding, 2, str(tmp_path))


class _ShardsItself(LitDecoder):
    """A LightningModule that applies fully_shard itself, as with Lightning's ModelParallelStrategy."""

    def configure_model(self):
        for block in self.model.layers:
            fully_shard(block, mesh=self.device_mesh, reshard_after_forward=False)


class _ShardsItselfWithTorchFSDP2(LitDecoder):
    """The same, written for ModelParallelStrategy: torch's fully_shard, looked up in the hook."""

    def configure_model(self):
        for block in self.model.layers:
            torch.distributed.fsdp.fully_shard(block, mesh=self.device_mesh, reshard_after_forward=False)


def _respects_configure_model(root, module_cls=_ShardsItself):
    module = module_cls()
    with launched_by_harness():
        trainer = make_trainer(root, strategy=VeScaleFSDPStrategy(auto_wrap_policy={"Attention"}))
        trainer.fit(module, loader(dataset(dist.get_world_size())))
    units = {name for name, m in module.named_modules() if getattr(m, "_vescale_fsdp_unit", None) is not None}
    assert units == {"", "model.layers.0", "model.layers.1"}, units  # the user's blocks + the root, no Attention unit
    assert module.model.layers[0]._vescale_fsdp_unit.reshard_after_forward is False
    assert all(torch.isfinite(torch.tensor(module.losses)))


def test_units_sharded_in_configure_model_are_kept(dist_run, tmp_path):
    dist_run(_respects_configure_model, 2, str(tmp_path))


def test_torch_fully_shard_in_configure_model_runs_ours(dist_run, tmp_path):
    """The strategy routes torch's ``fully_shard`` in ``configure_model`` to ours: the same units."""
    dist_run(_respects_configure_model, 2, str(tmp_path), _ShardsItselfWithTorchFSDP2)


def _policy_naming_no_module(root):
    module = LitDecoder()
    with launched_by_harness():
        trainer = make_trainer(root, strategy=VeScaleFSDPStrategy(auto_wrap_policy={"TransformerBlock"}))
        with pytest.raises(
            ValueError, match=r"names \['TransformerBlock'\], but LitDecoder contains no module"
        ) as error:
            trainer.fit(module, loader(dataset(dist.get_world_size())))
    assert not any(isinstance(p, DTensor) for p in module.parameters())  # failed before touching the model
    return str(error.value)


def test_wrap_policy_naming_no_module_fails_clearly_before_setup(dist_run, tmp_path):
    messages = dist_run(_policy_naming_no_module, 2, str(tmp_path))
    assert messages[0] == messages[1]
    assert "Block" in messages[0]


# ----------------------------------------------------------------------------------
# checkpoints: sharded and full, resume at the same and at another world size
# ----------------------------------------------------------------------------------


def _per_rank() -> int:
    return GLOBAL_BATCH // dist.get_world_size()


def _fit(root, module, max_epochs, ckpt_dir=None, ckpt_path=None, state_dict_type="sharded"):
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)] if ckpt_dir else []
    data = dataset(dist.get_world_size(), micro_batches=STEPS_PER_EPOCH, per_rank=_per_rank())
    trainer = make_trainer(
        root,
        strategy=VeScaleFSDPStrategy(state_dict_type=state_dict_type),
        max_epochs=max_epochs,
        enable_checkpointing=bool(ckpt_dir),
        callbacks=callbacks,
    )
    trainer.fit(module, loader(data, per_rank=_per_rank()), ckpt_path=ckpt_path)
    return module.global_losses


def _train_and_checkpoint(root):
    with launched_by_harness():
        uninterrupted = _fit(root, LitDecoder(), 2, ckpt_dir=f"{root}/sharded")
        first_epoch = _fit(root, LitDecoder(), 1, ckpt_dir=f"{root}/full", state_dict_type="full")
    assert first_epoch == uninterrupted[:STEPS_PER_EPOCH]
    return uninterrupted


def _resume(root, ckpt_path):
    with launched_by_harness():
        module = LitDecoder(layers=2)
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(0.5)  # the checkpoint, not the initialisation, must decide the weights
        return _fit(root, module, 2, ckpt_path=ckpt_path)


def test_checkpoints_resume_identically_at_the_same_and_another_world_size(dist_run, tmp_path):
    root = str(tmp_path)
    uninterrupted = dist_run(_train_and_checkpoint, 2, root, timeout=180)[0]
    sharded = Path(root, "sharded", f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
    full = Path(root, "full", f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
    assert sharded.is_dir()
    assert full.is_file()
    second_epoch = torch.tensor(uninterrupted[STEPS_PER_EPOCH:])

    for ckpt in (sharded, full):
        same_world = dist_run(_resume, 2, root, str(ckpt))[0]
        torch.testing.assert_close(
            torch.tensor(same_world), second_epoch, **EXACT, msg=lambda m: f"{ckpt.parent.name} at W=2: {m}"
        )
        other_world = dist_run(_resume, 3, root, str(ckpt))[0]
        torch.testing.assert_close(
            torch.tensor(other_world), second_epoch, **TOL, msg=lambda m: f"{ckpt.parent.name} at W=3: {m}"
        )

    # The full file is a standard Lightning checkpoint: a plain, unsharded module loads it as is,
    # and its weights are the ones the sharded checkpoint holds.
    plain = LitDecoder.load_from_checkpoint(full, map_location="cpu", weights_only=False)
    dcp_to_torch_save(sharded, tmp_path / "converted.pt")
    from_shards = torch.load(tmp_path / "converted.pt", weights_only=False)[MODEL_KEY]
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), from_shards[name], **PARAM_TOL, msg=lambda m: f"{name}: {m}")
    assert {"state_dict", "optimizer_states", "epoch", "global_step", "loops"} <= set(
        torch.load(full, weights_only=False)
    )

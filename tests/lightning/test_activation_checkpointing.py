"""Activation checkpointing through the Lightning strategy: every form trains what DDP trains.

The repository's decoder (uneven dims, tied head) as a LightningModule, trained by Lightning's
Trainer with gradient accumulation and clipping, by ``strategy="ddp"`` (the reference) and by
``vescale_fsdp`` with checkpointing set up the ways users do it: the strategy's
``activation_checkpointing_policy`` (as with Lightning's ``FSDPStrategy``) with the default
units (the checkpoint wrapper is the unit) and with ``auto_wrap_policy={Block}`` (the unit is
inside the wrapper), and ``torch.utils.checkpoint`` inside the model (reentrant and not); and Fabric's strategy with the
same policy.
Losses and parameters must match DDP to fp32 tolerance, and the blocks must really have been
recomputed (their forward runs twice per micro-batch). The Accelerate plugin's
``fsdp_activation_checkpointing: true`` is covered against DDP in ``test_hf_trainer.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from lightning_strategy import VeScaleFSDPStrategy
from tests.support.lightning_harness import (
    ACCUMULATE,
    CLIP,
    LAYERS,
    MICRO_BATCHES,
    LitDecoder,
    dataset,
    launched_by_harness,
    loader,
    make_trainer,
)
from tests.support.models import Block, loss_fn
from tests.support.parity import adamw

pytestmark = pytest.mark.timeout(600)  # several Trainer fits per test on a busy 2-core machine


class CheckpointedLitDecoder(LitDecoder):
    """Checkpointing written into the model: each block runs under ``torch.utils.checkpoint``."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.embed(tokens) * m.position_scale[:, : tokens.shape[1]]
        for layer in m.layers:
            x = checkpoint(layer, x, use_reentrant=self.use_reentrant)
        return m.head(m.norm(x))


def _full_params(module: LitDecoder) -> dict[str, torch.Tensor]:
    """The decoder's parameters, full (a collective under veScale), named as in the bare decoder."""
    out = {}
    for name, p in module.model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("._checkpoint_wrapped_module", "")] = t.detach().clone()
    return out


def _count_block_forwards(module: nn.Module) -> list[int]:
    calls = [0]
    for block in module.modules():
        if isinstance(block, Block):
            block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _fabric_fit(form: str) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
    """The same training written for Fabric with the strategy's activation_checkpointing_policy."""
    from lightning.fabric import Fabric

    from lightning_strategy import VeScaleFSDPFabricStrategy

    strategy = VeScaleFSDPFabricStrategy(activation_checkpointing_policy={Block})
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=dist.get_world_size())
    fabric.launch()
    module = LitDecoder()  # its decoder only: Fabric calls forward
    calls = _count_block_forwards(module)
    model, optimizer = fabric.setup(module.model, adamw(module.model))
    losses = []
    for i, (tokens, targets) in enumerate(fabric.setup_dataloaders(loader(dataset(dist.get_world_size())))):
        last = (i + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = loss_fn(model(tokens), targets)
            fabric.backward(loss / ACCUMULATE)
        losses.append(loss.item())
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
    wrappers = sum(isinstance(m, CheckpointWrapper) for m in module.modules())
    return losses, _full_params(module), calls[0], wrappers


def _fit(root: str, form: str) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
    if form == "fabric_policy":
        return _fabric_fit(form)
    strategy = "ddp" if form == "ddp" else VeScaleFSDPStrategy()
    module: LitDecoder = LitDecoder()
    if form == "policy":
        strategy = VeScaleFSDPStrategy(activation_checkpointing_policy={Block})
    elif form == "policy_inner_units":
        strategy = VeScaleFSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={"Block"})
    elif form in ("inside_model", "inside_model_reentrant"):
        module = CheckpointedLitDecoder(use_reentrant=form == "inside_model_reentrant")
    calls = _count_block_forwards(module)
    trainer = make_trainer(root, strategy=strategy, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP)
    trainer.fit(module, loader(dataset(dist.get_world_size())))
    wrappers = sum(isinstance(m, CheckpointWrapper) for m in module.modules())
    return module.losses, _full_params(module), calls[0], wrappers


def _checkpointing_matches_ddp(root: str, forms: list[str]) -> None:
    with launched_by_harness():
        want_losses, want_params, plain_calls, _ = _fit(root, "ddp")
        assert len(want_losses) == MICRO_BATCHES
        assert plain_calls == MICRO_BATCHES * LAYERS
        for form in forms:
            losses, params, calls, wrappers = _fit(root, form)
            assert wrappers == (LAYERS if "policy" in form else 0), (form, wrappers)
            # Recomputed: each block's forward ran again in backward.
            assert calls == (plain_calls if form == "no_checkpointing" else 2 * plain_calls), (form, calls)
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(want_losses), msg=lambda m: f"{form} losses: {m}"
            )
            assert params.keys() == want_params.keys(), form
            for name, value in want_params.items():
                torch.testing.assert_close(params[name], value, msg=lambda m: f"{form} {name}: {m}")


FORMS = ["no_checkpointing", "policy", "policy_inner_units", "inside_model", "inside_model_reentrant", "fabric_policy"]


def test_every_checkpointing_form_matches_ddp_under_the_lightning_strategy(dist_run, tmp_path):
    dist_run(_checkpointing_matches_ddp, 2, str(tmp_path), FORMS, timeout=420)


def test_checkpointing_policy_matches_ddp_on_three_ranks(dist_run, tmp_path):
    dist_run(_checkpointing_matches_ddp, 3, str(tmp_path), ["policy"], timeout=420)


def test_policy_naming_no_module_of_the_model_fails_at_setup():
    from lightning_strategy.activation_checkpointing import LayerCheckpointing

    with pytest.raises(ValueError, match=r"names \['Blok'\].*contains: \[.*'Block'"):
        LayerCheckpointing.from_policy({"Blok"}).apply(LitDecoder())
    with pytest.raises(TypeError, match="activation_checkpointing_policy must name nn.Module classes"):
        VeScaleFSDPStrategy(activation_checkpointing_policy={int})
    with pytest.raises(TypeError, match="activation_checkpointing_policy must be None"):
        VeScaleFSDPStrategy(activation_checkpointing_policy=3)


def test_policy_on_a_model_with_checkpoint_wrappers_already_is_ignored_with_a_warning():
    from lightning_strategy.activation_checkpointing import LayerCheckpointing

    module = LitDecoder()
    module.model.layers[0] = checkpoint_wrapper(module.model.layers[0])
    with pytest.warns(UserWarning, match="already contains checkpointed layers"):
        LayerCheckpointing.from_policy({Block}).apply(module)
    assert sum(isinstance(m, CheckpointWrapper) for m in module.modules()) == 1

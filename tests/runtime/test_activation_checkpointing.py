"""Activation checkpointing in every form users apply it trains exactly what FSDP2 and an
unsharded model train.

Forms: ``torch.utils.checkpoint`` inside a block (reentrant and not), ``checkpoint_wrapper``
through ``apply_activation_checkpointing`` before ``fully_shard`` (as torchtitan and
Accelerate do), a block whose ``__call__`` checkpoints the whole module call so the unit's
own hooks run again during the recomputation (Hugging Face's ``GradientCheckpointingLayer``),
the composable ``checkpoint(module)``, a unit nested inside a checkpointed block, and
LitGPT's LoRA ``parallelize_fn``: ``fully_shard`` on each wrapped block, then on its
``CheckpointWrapper`` (a unit with no parameters of its own), then on the root.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from tests.support import models
from tests.support.models import clone, make_decoder, reference_step
from tests.support.parity import PARAM_TOL, TOL, adamw, sharded_step, step_and_zero
from vescale_plugins import fully_shard

STEPS = 3


class InnerCheckpointBlock(models.Block):
    """Checkpoints its MLP half with ``torch.utils.checkpoint`` inside ``forward``."""

    use_reentrant = False

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + checkpoint(self._mlp, x, use_reentrant=self.use_reentrant)

    def _mlp(self, x):
        return self.down(F.gelu(self.up(self.mlp_norm(x))))


class ReentrantInnerCheckpointBlock(InnerCheckpointBlock):
    use_reentrant = True


class WholeCallCheckpointBlock(models.Block):
    """Checkpoints ``nn.Module.__call__`` itself, hooks included (Hugging Face's layers)."""

    use_reentrant = False

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().__call__(*args, **kwargs)
        return checkpoint(functools.partial(super().__call__, **kwargs), *args, use_reentrant=self.use_reentrant)


class ReentrantWholeCallCheckpointBlock(WholeCallCheckpointBlock):
    use_reentrant = True


def _with_blocks(model, block_cls):
    for block in model.layers:
        block.__class__ = block_cls
    return model


def _prepare(form, model, shard, reshard_after_forward):
    """Apply checkpointing in ``form``, then ``shard`` each block and the root."""
    kwargs = dict(reshard_after_forward=reshard_after_forward)
    if form in ("inner", "inner-reentrant"):
        _with_blocks(model, InnerCheckpointBlock if form == "inner" else ReentrantInnerCheckpointBlock)
    elif form in ("whole-call", "whole-call-reentrant"):
        _with_blocks(model, WholeCallCheckpointBlock if form == "whole-call" else ReentrantWholeCallCheckpointBlock)
    elif form in ("wrapper", "wrapper-reentrant"):
        impl = CheckpointImpl.NO_REENTRANT if form == "wrapper" else CheckpointImpl.REENTRANT
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, models.Block),
        )
    elif form == "composable":
        for block in model.layers:
            composable_checkpoint(block)
    elif form == "nested":
        _with_blocks(model, WholeCallCheckpointBlock)
        if shard is not None:
            for block in model.layers:
                shard(block.up, **kwargs)
    elif form == "wrapper-then-inner":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, models.Block))
        if shard is not None:
            for wrapper in model.layers:
                shard(wrapper._checkpoint_wrapped_module, **kwargs)
    if shard is not None:
        for block in model.layers:
            shard(block, **kwargs)
        shard(model, **kwargs)
    return model


def _named(model, what):
    """Full parameters or gradients by name (checkpoint wrappers' prefixes removed)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach() if what == "param" else p.grad
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name.replace("_checkpoint_wrapped_module.", "")] = t
    return out


def assert_matches(ours, other, what):
    tol = PARAM_TOL if what == "param" else TOL
    got, want = _named(ours, what), _named(other, what)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert isinstance(got[name], torch.Tensor), f"{what} {name}: {got[name]!r}"
        torch.testing.assert_close(got[name], w, **tol, msg=lambda m: f"{what} {name}: {m}")


def _parity(form, reshard_after_forward):
    world = torch.distributed.get_world_size()
    reference = make_decoder()  # checkpointing changes no arithmetic
    ours = _prepare(form, clone(make_decoder()), fully_shard, reshard_after_forward)
    theirs = _prepare(form, clone(make_decoder()), torch_fully_shard, reshard_after_forward)
    opts = [adamw(m) for m in (reference, ours, theirs)]
    for step in range(STEPS):
        ref_loss = reference_step(reference, step, world)
        loss, their_loss = sharded_step(ours, step), sharded_step(theirs, step)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        torch.testing.assert_close(loss, their_loss, **TOL)
        assert_matches(ours, reference, "grad")
        assert_matches(ours, theirs, "grad")
        for name, p in ours.named_parameters():
            assert isinstance(p, DTensor), f"{name} left unsharded after backward"
        step_and_zero(*opts)
        assert_matches(ours, reference, "param")
        assert_matches(ours, theirs, "param")


FORMS = [
    "inner",
    "inner-reentrant",
    "whole-call",
    "whole-call-reentrant",
    "wrapper",
    "wrapper-reentrant",
    "composable",
    "nested",
    "wrapper-then-inner",
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_activation_checkpointing_matches_fsdp2_and_unsharded(dist_run, form, reshard_after_forward):
    dist_run(_parity, 2, form, reshard_after_forward)


@pytest.mark.parametrize("form", ["whole-call", "wrapper-reentrant"])
def test_activation_checkpointing_at_three_ranks(dist_run, form):
    dist_run(_parity, 3, form, None)

"""Accelerate with VeScaleFSDPPlugin trains exactly what a plain ``fully_shard`` loop trains.

Each body runs on W gloo ranks with Accelerate's real ``prepare``/``accumulate``/``backward``/
``clip_grad_norm_`` on the CPU path (Accelerate's ``MULTI_CPU``, which the plugin turns into
FSDP). The plain loop shards the same model the same way by hand; an unsharded model fed the
global batch checks the clipped global norm and the updates independently of both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from tests.support.accelerate_harness import MAX_GRAD_NORM, accelerate_env, decaying_lr, decoder_plugin, token_loader
from tests.support.models import PER_RANK, clone, local_batch, loss_fn, make_decoder, reference_step
from tests.support.parity import EXACT, TOL, adamw, assert_matches, assert_same_params, full_params, shard_decoder
from vescale_plugins import RaggedShard


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """Accelerate's ``clip_grad_norm_`` returns the sharded norm as a DTensor up to 1.15 and as
    a plain (already reduced) tensor from 1.16 (``_clip_grad_norm_dtensor_aware``)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _accelerate_matches_plain_loop(accumulation: int, mixed_precision: str) -> None:
    world = dist.get_world_size()
    optimizer_steps = 3
    initial = make_decoder()
    mp_policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        # What Accelerate's mixed_precision="bf16" means for an FSDP2 plugin.
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16
        )
    plain = shard_decoder(clone(initial), mp_policy=mp_policy)
    plain_opt = adamw(plain)
    plain_lr = decaying_lr(plain_opt)
    reference = clone(initial)
    reference_opt = adamw(reference)

    with accelerate_env():
        accelerator = Accelerator(
            fsdp_plugin=decoder_plugin(), gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision
        )
        assert accelerator.distributed_type == DistributedType.FSDP
        assert accelerator.is_fsdp2
        model = clone(initial)
        optimizer = adamw(model)
        model, optimizer, loader, lr = accelerator.prepare(
            model, optimizer, token_loader(optimizer_steps * accumulation), decaying_lr(optimizer)
        )
        assert all(isinstance(p.placements[0], RaggedShard) for p in model.parameters())
        assert accelerator.unwrap_model(model) is model

        for micro, (tokens, targets) in enumerate(loader):
            with accelerator.accumulate(model):
                loss = loss_fn(model(tokens), targets)
                accelerator.backward(loss)
                norm = (
                    accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                    if accelerator.sync_gradients
                    else None
                )
                optimizer.step()
                lr.step()
                optimizer.zero_grad()

            is_last = (micro + 1) % accumulation == 0
            plain.set_requires_gradient_sync(is_last)
            plain_tokens, plain_targets = local_batch(micro, PER_RANK)
            assert torch.equal(plain_tokens, tokens), "Accelerate's dataloader gave this rank another batch"
            plain_loss = loss_fn(plain(plain_tokens), plain_targets)
            (plain_loss / accumulation).backward()
            torch.testing.assert_close(loss, plain_loss, **EXACT)
            if mixed_precision == "no":
                reference_loss = reference_step(reference, micro, world, PER_RANK)
                global_loss = loss.detach().clone()
                dist.all_reduce(global_loss)
                torch.testing.assert_close(global_loss / world, reference_loss, **TOL)
            if not is_last:
                assert norm is None
                continue

            plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_GRAD_NORM)
            torch.testing.assert_close(_whole(norm), plain_norm.full_tensor(), **EXACT)
            if mixed_precision == "no":
                for p in reference.parameters():
                    p.grad /= accumulation  # the reference summed the mean-loss gradients of each micro-batch
                reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
                torch.testing.assert_close(_whole(norm), reference_norm, **TOL)
                for group in reference_opt.param_groups:
                    group["lr"] = plain_opt.param_groups[0]["lr"]
                reference_opt.step()
                reference_opt.zero_grad()
            plain_opt.step()
            for _ in range(world):  # Accelerate steps a scheduler once per process per optimizer step
                plain_lr.step()
            plain_opt.zero_grad()
            assert_same_params(full_params(model), full_params(plain), EXACT)
            if mixed_precision == "no":
                assert_matches(model, reference, "param")
        assert optimizer.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_prepare_backward_clip_accumulate_match_plain_fully_shard(dist_run, world, accumulation):
    dist_run(_accelerate_matches_plain_loop, world, accumulation, "no")


def test_mixed_precision_bf16_matches_fully_shard_with_the_same_policy(dist_run):
    dist_run(_accelerate_matches_plain_loop, 2, 1, "bf16")


def _offload_params_trains_like_fully_shard_with_cpu_offload() -> None:
    initial = make_decoder()
    policy = CPUOffloadPolicy(pin_memory=False)  # what FSDP2 trains with where there is no accelerator
    plain = shard_decoder(clone(initial), offload_policy=policy)
    plain_opt = adamw(plain)
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin(cpu_offload=policy))
        model = clone(initial)
        model, optimizer = accelerator.prepare(model, adamw(model))
        assert all(m._vescale_fsdp_unit.offload == policy for m in (model, *model.layers))
        for step in range(2):
            tokens, targets = local_batch(step, PER_RANK)
            loss = loss_fn(model(tokens), targets)
            accelerator.backward(loss)
            plain_loss = loss_fn(plain(tokens), targets)
            plain_loss.backward()
            torch.testing.assert_close(loss, plain_loss, **EXACT)
            for opt in (optimizer, plain_opt):
                opt.step()
                opt.zero_grad()
        assert_same_params(full_params(model), full_params(plain), EXACT)


def test_offload_params_trains_like_fully_shard_with_cpu_offload(dist_run):
    dist_run(_offload_params_trains_like_fully_shard_with_cpu_offload, 2)


def _bf16_weights_become_fp32_masters() -> None:
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin(), mixed_precision="bf16")
        model = make_decoder().to(torch.bfloat16)
        model, optimizer = accelerator.prepare(model, adamw(model))
        assert all(p.dtype == torch.float32 for p in model.parameters())
        tokens, targets = local_batch(0, PER_RANK)
        logits = model(tokens)
        assert logits.dtype == torch.bfloat16
        accelerator.backward(loss_fn(logits, targets))
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_mixed_precision_keeps_fp32_master_weights_as_fsdp2_under_accelerate(dist_run):
    dist_run(_bf16_weights_become_fp32_masters, 2)


def _activation_checkpointing_changes_nothing_but_memory() -> None:
    initial = make_decoder()
    plain = shard_decoder(clone(initial))
    plain_opt = adamw(plain)
    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=decoder_plugin(activation_checkpointing=True))
        model = clone(initial)
        optimizer = adamw(model)
        model, optimizer = accelerator.prepare(model, optimizer)
        # Accelerate wrapped each block for recomputation; the wrapper is the sharding unit.
        assert all(type(layer).__name__ == "FSDPCheckpointWrapper" for layer in model.layers)
        for step in range(2):
            tokens, targets = local_batch(step, PER_RANK)
            loss = loss_fn(model(tokens), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            plain_loss = loss_fn(plain(tokens), targets)
            plain_loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            torch.testing.assert_close(loss, plain_loss, **EXACT)
        # Parameter names seen from the root include the wrapper's prefix (as under FSDP2).
        got = {name.replace("._checkpoint_wrapped_module", ""): p for name, p in full_params(model).items()}
        assert_same_params(got, full_params(plain), EXACT)


def test_activation_checkpointing_trains_the_same(dist_run):
    dist_run(_activation_checkpointing_changes_nothing_but_memory, 2)

"""Lightning's Trainer and Fabric train exactly what a plain loop with veScale-FSDP trains.

Each body runs on W gloo ranks and trains the same decoder three ways on the same batches
(a DistributedSampler over one dataset): a plain loop over ``shard_model``, a Trainer with
``strategy="vescale_fsdp"``, and Fabric with ``strategy="vescale_fsdp"``; with gradient
accumulation (no communication on accumulating steps) and clipping by global norm. Losses
must agree step for step and parameters at the end. Both add a shuffled DistributedSampler
themselves, which the plain loop spells out. The three engines run the same ops in the same
order on the same layouts: bit-for-bit equal, in bf16 as in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_strategy import VeScaleFSDPFabricStrategy, VeScaleFSDPStrategy
from tests.support.lightning_harness import (
    ACCUMULATE,
    CLIP,
    LAYERS,
    MICRO_BATCHES,
    LitDecoder,
    dataset,
    launched_by_harness,
    loader,
    make_fabric,
    make_trainer,
    reduce_scatters,
)
from tests.support.models import PER_RANK, loss_fn, make_decoder
from tests.support.parity import EXACT, adamw, assert_same_params, full_params
from vescale_plugins.wrap import shard_model

_MP_POLICIES = {
    "32-true": MixedPrecisionPolicy(),
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-true": MixedPrecisionPolicy(),
}


def plain_loop(data: Dataset, precision: str, accumulate: int, clip: float | None, mesh_shape: tuple | None = None):
    """The reference: shard_model and a hand-written loop, as a plain-torch user would write it."""
    model = make_decoder(seed=0, layers=LAYERS)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    model = shard_model(model, mp_policy=_MP_POLICIES[precision], mesh=mesh)
    optimizer = adamw(model)
    # What the Trainer and Fabric put in place of a DataLoader's sampler: shuffled, seed 0, epoch 0.
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=0)
    losses = []
    for i, (tokens, targets) in enumerate(DataLoader(data, batch_size=PER_RANK, sampler=sampler)):
        last = (i + 1) % accumulate == 0
        model.set_requires_gradient_sync(last)
        loss = loss_fn(model(tokens), targets)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if last:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses, full_params(model)


def fabric_loop(data: Dataset, precision: str, accumulate: int, clip: float | None, mesh_shape: tuple | None = None):
    """The same loop written for Fabric, as its docs show (setup, no_backward_sync, clip_gradients)."""
    fabric = (
        make_fabric(precision=precision, strategy=VeScaleFSDPFabricStrategy(device_mesh=mesh_shape))
        if mesh_shape
        else make_fabric(precision=precision)
    )
    model = make_decoder(seed=0, layers=LAYERS)
    model, optimizer = fabric.setup(model, adamw(model))  # optimizer built before sharding, as with DDP
    losses, synced = [], []
    for i, (tokens, targets) in enumerate(fabric.setup_dataloaders(loader(data))):
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = loss_fn(model(tokens), targets)
            synced.append(reduce_scatters(lambda: fabric.backward(loss / accumulate)))
        losses.append(loss.item())
        if last:
            if clip is not None:
                norm = fabric.clip_gradients(model, optimizer, max_norm=clip)
                assert not isinstance(norm, torch.distributed.tensor.DTensor)
                assert norm > clip
            optimizer.step()
            optimizer.zero_grad()
    return losses, full_params(model.module), synced


def trainer_loop(
    root: str, data: Dataset, precision: str, accumulate: int, clip: float | None, mesh_shape: tuple | None = None
):
    module = LitDecoder()
    strategy = VeScaleFSDPStrategy(device_mesh=mesh_shape) if mesh_shape else "vescale_fsdp"
    trainer = make_trainer(
        root, strategy=strategy, precision=precision, accumulate_grad_batches=accumulate, gradient_clip_val=clip
    )
    trainer.fit(module, loader(data))
    return module.losses, full_params(module, prefix="model."), module.backward_reduce_scatters


def _three_ways(root, precision, accumulate, clip, mesh_shape=None):
    data = dataset(dist.get_world_size())
    with launched_by_harness():
        want_losses, want_params = plain_loop(data, precision, accumulate, clip, mesh_shape)
        fabric_losses, fabric_params, fabric_synced = fabric_loop(data, precision, accumulate, clip, mesh_shape)
        trainer_losses, trainer_params, trainer_synced = trainer_loop(
            root, data, precision, accumulate, clip, mesh_shape
        )
    assert len(want_losses) == MICRO_BATCHES
    torch.testing.assert_close(
        torch.tensor(fabric_losses), torch.tensor(want_losses), **EXACT, msg=lambda m: f"Fabric losses: {m}"
    )
    torch.testing.assert_close(
        torch.tensor(trainer_losses), torch.tensor(want_losses), **EXACT, msg=lambda m: f"Trainer losses: {m}"
    )
    assert_same_params(fabric_params, want_params, EXACT)
    assert_same_params(trainer_params, want_params, EXACT)
    # Accumulating micro-batches communicate nothing; the last one of each step reduces every unit.
    for synced in (fabric_synced, trainer_synced):
        assert [n > 0 for n in synced] == [(i + 1) % accumulate == 0 for i in range(MICRO_BATCHES)], synced
    return want_losses


@pytest.mark.parametrize("world", [2, 3])
def test_trainer_and_fabric_match_a_plain_loop_with_accumulation_and_clipping(dist_run, tmp_path, world):
    losses = dist_run(_three_ways, world, str(tmp_path), "32-true", ACCUMULATE, CLIP, timeout=180)
    assert losses[0] != losses[1]  # each rank saw its own batches


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_trainer_and_fabric_match_a_plain_loop_in_bf16(dist_run, tmp_path, precision):
    dist_run(_three_ways, 2, str(tmp_path), precision, 1, None, timeout=180)


def test_trainer_and_fabric_hybrid_sharding_on_a_2x2_device_mesh(dist_run, tmp_path):
    """``device_mesh=(2, 2)``, as Lightning's FSDPStrategy takes it for HYBRID_SHARD."""
    dist_run(_three_ways, 4, str(tmp_path), "32-true", ACCUMULATE, CLIP, (2, 2), timeout=240)

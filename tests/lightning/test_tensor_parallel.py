"""Tensor parallelism through the Lightning strategies, configured as Lightning's
``ModelParallelStrategy`` is: ``data_parallel_size`` x ``tensor_parallel_size``, the model's
``configure_model`` (Trainer) or ``parallelize_fn`` (Fabric) applying ``parallelize_module`` on
``device_mesh["tensor_parallel"]``, and the strategy sharding over ``"data_parallel"``.

On 4 gloo ranks (DP=2 x TP=2; for Fabric a DeviceMesh ``(replicate=2, shard=1,
tensor_parallel=2)``, HSDP x TP), a few AdamW steps with clipping train what FSDP2 (torch's
``fully_shard``) with the same TP plan trains on the same batches, and what one unsharded
model trains on the data-parallel ranks' batches together; the two ranks of a
tensor-parallel group read the same batches, the two data-parallel groups different ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.utils.data import DataLoader

from lightning_strategy import VeScaleFSDPFabricStrategy, VeScaleFSDPStrategy
from tests.support.lightning_harness import launched_by_harness, make_fabric, make_trainer
from tests.support.tp_transformer import (
    BATCH,
    Transformer,
    assert_same,
    assert_trained_like_fsdp2_and_unsharded,
    default_adamw,
    lm_loss,
    tensor_parallel,
    token_dataset,
)
from vescale_plugins.ragged.placement import StridedRaggedShard

pytestmark = pytest.mark.timeout(240)

DP, TP, STEPS, CLIP = 2, 2, 3, 0.5


EXAMPLES = DP * BATCH * STEPS  # one batch per data-parallel rank and step


class _LitTensorParallel(LightningModule):
    """What a ModelParallelStrategy user writes: TP in configure_model, no sharding code."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        tensor_parallel(self.model, self.device_mesh["tensor_parallel"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        self.batches.append((batch[0].clone(), batch[1].clone()))
        loss = lm_loss(self, *batch)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return default_adamw(self)


def _trainer_run(root: str, initial: Transformer):
    module = _LitTensorParallel(copy.deepcopy(initial))
    trainer = make_trainer(
        root, strategy=VeScaleFSDPStrategy(data_parallel_size=DP, tensor_parallel_size=TP), gradient_clip_val=CLIP
    )
    trainer.fit(module, DataLoader(token_dataset(EXAMPLES), batch_size=BATCH, shuffle=True))
    return module.model, trainer.strategy.device_mesh, module.batches, module.losses


def _fabric_run(root: str, initial: Transformer):
    mesh = init_device_mesh("cpu", (DP, 1, TP), mesh_dim_names=("replicate", "shard", "tensor_parallel"))
    strategy = VeScaleFSDPFabricStrategy(
        device_mesh=mesh, parallelize_fn=lambda m, mesh: tensor_parallel(m, mesh["tensor_parallel"])
    )
    fabric = make_fabric(strategy=strategy)
    model = copy.deepcopy(initial)
    model, optimizer = fabric.setup(model, default_adamw(model))  # optimizer built before TP and sharding
    batches, losses = [], []
    for tokens, targets in fabric.setup_dataloaders(
        DataLoader(token_dataset(EXAMPLES), batch_size=BATCH, shuffle=True)
    ):
        batches.append((tokens.clone(), targets.clone()))
        loss = lm_loss(model, tokens, targets)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return model.module, strategy.device_mesh, batches, losses


def _matches_fsdp2_and_unsharded(front_end: str, root: str) -> None:
    initial = Transformer()
    with launched_by_harness():
        ours, mesh, batches, losses = (_trainer_run if front_end == "trainer" else _fabric_run)(root, initial)
    names = (
        ("data_parallel", "tensor_parallel") if front_end == "trainer" else ("replicate", "shard", "tensor_parallel")
    )
    assert mesh.mesh_dim_names == names
    assert mesh.size() == DP * TP
    dp_names = names[:-1]
    wq = ours.layers[0].attn.wq.weight
    assert wq.device_mesh.mesh_dim_names == names
    assert type(wq.placements[-2]) is StridedRaggedShard
    assert wq.placements[-1] == Shard(0)
    assert all(p == Replicate() for p in wq.placements[:-2])  # HSDP: replicated across replicas
    assert len(batches) == STEPS

    # Every rank's batches: a tensor-parallel group shares them, the data-parallel groups split the data.
    tp_groups = mesh.mesh.reshape(-1, TP).tolist()
    assert_trained_like_fsdp2_and_unsharded(
        ours, initial, batches, losses, tp_groups, mesh["tensor_parallel"], mesh[dp_names], CLIP
    )


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_tensor_parallel_x_vescale_fsdp_matches_fsdp2_and_unsharded(dist_run, tmp_path, front_end):
    dist_run(_matches_fsdp2_and_unsharded, 4, front_end, str(tmp_path), timeout=200)


def _fabric_tp(initial: Transformer, state_dict_type: str = "sharded"):
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("data_parallel", "tensor_parallel"))
    strategy = VeScaleFSDPFabricStrategy(
        device_mesh=mesh,
        parallelize_fn=lambda m, mesh: tensor_parallel(m, mesh["tensor_parallel"]),
        state_dict_type=state_dict_type,
    )
    fabric = make_fabric(strategy=strategy)
    model = fabric.setup_module(copy.deepcopy(initial))
    return fabric, model, fabric.setup_optimizers(default_adamw(model))


def _tp_step(fabric, model, optimizer, step: int) -> torch.Tensor:
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()
    tokens, targets = token_dataset(EXAMPLES)[(step * DP + dp_rank) * BATCH : (step * DP + dp_rank + 1) * BATCH]
    loss = lm_loss(model, tokens, targets)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _checkpoints_round_trip(root: str) -> None:
    """DP x TP through Fabric: a sharded checkpoint (DCP) loads into a fresh model and the
    two continue identically; a full checkpoint is the unsharded model's state dict."""
    initial = Transformer()
    with launched_by_harness():
        fabric, model, optimizer = _fabric_tp(initial)
        _tp_step(fabric, model, optimizer, 0)
        saved = {name: p.full_tensor().detach() for name, p in model.module.named_parameters()}
        fabric.save(f"{root}/sharded", {"model": model, "optimizer": optimizer, "step": 1})
        full_writer = _fabric_tp(initial, state_dict_type="full")[0]
        full_writer.save(f"{root}/full.ckpt", {"model": model, "optimizer": optimizer})

        fabric2, restored, restored_optimizer = _fabric_tp(_perturbed(initial))
        state = {"model": restored, "optimizer": restored_optimizer, "step": 0}
        assert fabric2.load(f"{root}/sharded", state) == {}
        assert state["step"] == 1
        assert_same(restored.module, model.module, "param", {"rtol": 0, "atol": 0})
        for step in (1, 2):  # the optimizer state came back too: the same updates, bit for bit
            torch.testing.assert_close(
                _tp_step(fabric2, restored, restored_optimizer, step),
                _tp_step(fabric, model, optimizer, step),
                rtol=0,
                atol=0,
            )
        assert_same(restored.module, model.module, "param", {"rtol": 0, "atol": 0})
    full = torch.load(f"{root}/full.ckpt", weights_only=False)
    assert set(full) == {"model", "optimizer"}
    plain = _perturbed(initial)
    plain.load_state_dict(full["model"])  # unsharded names and shapes
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def _perturbed(model: Transformer) -> Transformer:
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    return other


def test_tensor_parallel_checkpoints_through_fabric(dist_run, tmp_path):
    dist_run(_checkpoints_round_trip, 4, str(tmp_path), timeout=200)

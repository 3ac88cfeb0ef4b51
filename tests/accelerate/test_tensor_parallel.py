"""Tensor parallelism through the Accelerate plugin, configured as Accelerate users do:
``ParallelismConfig(dp_shard_size=2, tp_size=2)``, the model's TP plan applied on
``accelerator.torch_device_mesh["tp"]`` before ``prepare``, and veScale-FSDP sharding over
the data-parallel dims of that mesh (``dp_shard_cp``, as FSDP2 under Accelerate).

On 4 gloo ranks, a few steps of Accelerate's own loop (its DataLoader, ``backward``,
``clip_grad_norm_``) train what FSDP2 (torch's ``fully_shard``) with the same TP plan trains
on the same batches, and what one unsharded model trains on the data-parallel ranks' batches
together; a tensor-parallel group reads the same batches. ``save_state`` / ``load_state``
then bring back the parameters and the optimizer state exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from torch.distributed.tensor import Shard
from torch.utils.data import DataLoader

from accelerate_plugin import VeScaleFSDPPlugin
from tests.support.accelerate_harness import accelerate_env
from tests.support.tp_transformer import (
    BATCH,
    Transformer,
    assert_trained_like_fsdp2_and_unsharded,
    default_adamw,
    lm_loss,
    tensor_parallel,
    token_dataset,
)
from vescale_plugins.ragged.placement import StridedRaggedShard

pytestmark = pytest.mark.timeout(240)

DP, TP, STEPS, CLIP = 2, 2, 3, 0.5


def _matches_fsdp2_and_unsharded(root: str) -> None:
    initial = Transformer()
    with accelerate_env():
        plugin = VeScaleFSDPPlugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
        accelerator = Accelerator(
            fsdp_plugin=plugin, parallelism_config=ParallelismConfig(dp_shard_size=DP, tp_size=TP)
        )
        mesh = accelerator.torch_device_mesh
        model = tensor_parallel(copy.deepcopy(initial), mesh["tp"])
        model, optimizer, loader = accelerator.prepare(
            model, default_adamw(model), DataLoader(token_dataset(DP * BATCH * STEPS), batch_size=BATCH)
        )
        wq = model.layers[0].attn.wq.weight
        assert wq.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp")
        assert type(wq.placements[0]) is StridedRaggedShard
        assert wq.placements[1] == Shard(0)
        batches, losses = [], []
        for tokens, targets in loader:
            batches.append((tokens.clone(), targets.clone()))
            loss = lm_loss(model, tokens, targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
        assert len(batches) == STEPS

        tp_groups = mesh["dp_shard", "tp"].mesh.tolist()
        assert_trained_like_fsdp2_and_unsharded(
            model, initial, batches, losses, tp_groups, mesh["tp"], mesh["dp_shard"], CLIP
        )

        # A checkpoint with TP: a step taken from it after load_state is the step taken right
        # after save_state, bit for bit (parameters and AdamW's moments and step came back).
        saved = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
        accelerator.save_state(f"{root}/state")
        tokens, targets = batches[0]
        after = []
        for _ in range(2):
            accelerator.backward(lm_loss(model, tokens, targets))
            optimizer.step()
            optimizer.zero_grad()
            after.append({name: p.full_tensor().detach() for name, p in model.named_parameters()})
            accelerator.load_state(f"{root}/state")
            for name, p in model.named_parameters():
                assert torch.equal(p.full_tensor(), saved[name]), name
        for name in saved:
            assert not torch.equal(after[0][name], saved[name]) or name.endswith("norm.bias"), name
            assert torch.equal(after[0][name], after[1][name]), name


def test_parallelism_config_tp_x_dp_shard_matches_fsdp2_and_unsharded(dist_run, tmp_path):
    dist_run(_matches_fsdp2_and_unsharded, 4, str(tmp_path), timeout=200)

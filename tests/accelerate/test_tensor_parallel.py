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
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard
from torch.utils.data import DataLoader, TensorDataset

from accelerate_plugin import VeScaleFSDPPlugin
from test_accelerate_parity import accelerate_env
from test_fsdp_tensor_parallel import (
    BATCH,
    LOSS_TOL,
    PARAM_TOL,
    SEQ,
    VOCAB,
    Transformer,
    _adamw,
    _assert_same,
    _loss,
    data_parallel,
    tensor_parallel,
)
from vescale_plugins.ragged.placement import StridedRaggedShard

pytestmark = pytest.mark.timeout(240)

DP, TP, STEPS, CLIP = 2, 2, 3, 0.5


def _tokens() -> TensorDataset:
    data = torch.randint(0, VOCAB, (DP * BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return TensorDataset(data[:, :-1], data[:, 1:])


def _matches_fsdp2_and_unsharded(root: str) -> None:
    initial = Transformer()
    with accelerate_env():
        plugin = VeScaleFSDPPlugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
        accelerator = Accelerator(fsdp_plugin=plugin, parallelism_config=ParallelismConfig(dp_shard_size=DP, tp_size=TP))
        mesh = accelerator.torch_device_mesh
        model = tensor_parallel(copy.deepcopy(initial), mesh["tp"])
        model, optimizer, loader = accelerator.prepare(model, _adamw(model), DataLoader(_tokens(), batch_size=BATCH))
        wq = model.layers[0].attn.wq.weight
        assert wq.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp")
        assert type(wq.placements[0]) is StridedRaggedShard and wq.placements[1] == Shard(0)
        batches, losses = [], []
        for tokens, targets in loader:
            batches.append((tokens.clone(), targets.clone()))
            loss = _loss(model, tokens, targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
        assert len(batches) == STEPS

        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, batches)
        groups = mesh["dp_shard", "tp"].mesh.tolist()  # groups[d]: the TP group of data-parallel rank d
        for group in groups:
            for rank in group:
                assert all(torch.equal(a[0], b[0]) for a, b in zip(everyone[rank], everyone[group[0]]))
        assert not torch.equal(everyone[groups[0][0]][0][0], everyone[groups[1][0]][0][0])

        fsdp2 = data_parallel(tensor_parallel(copy.deepcopy(initial), mesh["tp"]), torch_fully_shard, mesh["dp_shard"])
        reference = copy.deepcopy(initial)
        optimizers = [_adamw(fsdp2), _adamw(reference)]
        for step, (tokens, targets) in enumerate(batches):
            fsdp2_loss = _loss(fsdp2, tokens, targets)
            fsdp2_loss.backward()
            torch.testing.assert_close(losses[step], fsdp2_loss.detach(), **LOSS_TOL)
            dp_batches = [everyone[group[0]][step] for group in groups]
            (sum(_loss(reference, *b) for b in dp_batches) / len(dp_batches)).backward()
            for m in (fsdp2, reference):
                torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        _assert_same(model, fsdp2, "param", PARAM_TOL)
        _assert_same(model, reference, "param", PARAM_TOL)

        # A checkpoint with TP: a step taken from it after load_state is the step taken right
        # after save_state, bit for bit (parameters and AdamW's moments and step came back).
        saved = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
        accelerator.save_state(f"{root}/state")
        tokens, targets = batches[0]
        after = []
        for _ in range(2):
            accelerator.backward(_loss(model, tokens, targets))
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

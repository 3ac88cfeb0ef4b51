"""test_fully_shard_state_dict.py (FSDP2) on CPU/gloo.

The DP x TP and HSDP x TP cases are in test_compat_tensor_parallel.py; the CPU-offload
case runs with ``CPUOffloadPolicy(pin_memory=False)`` (pinning needs an accelerator).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from ._compat import api, state_dict_save_load, tc

T = 180
vescale_xfail = lambda reason: pytest.mark.vescale_xfail(reason)


def _dp_state_dict_save_load(impl, mlp_dim):
    A = api(impl)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(42)
    base_model = nn.Sequential(MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim))
    fully_shard_fn = functools.partial(A.fully_shard, mesh=mesh)
    model1 = copy.deepcopy(base_model)
    for module in model1:
        fully_shard_fn(module)
    fully_shard_fn(model1)
    state_dict_save_load(model1, impl)
    model2 = copy.deepcopy(base_model)
    for module in model2:
        fully_shard_fn(module, reshard_after_forward=False)
    fully_shard_fn(model2, reshard_after_forward=False)
    state_dict_save_load(model2, impl)
    ref_sharded_sd = model2.state_dict()
    model2(torch.randn((2, mlp_dim)))  # parameters are not resharded after this forward
    sharded_sd = model2.state_dict()
    tc.assertEqual(set(ref_sharded_sd.keys()), set(sharded_sd.keys()))
    for key, value in ref_sharded_sd.items():
        tc.assertEqual(value, sharded_sd[key])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mlp_dim", [2, 3, 4, 5])
def test_dp_state_dict_save_load(dist_run, impl, mlp_dim, world_size):
    dist_run(_dp_state_dict_save_load, world_size, impl, mlp_dim, timeout=T)


def _cached_state_dict(impl, mlp_dim, mutate_after_state_dict):
    A = api(impl)
    torch.manual_seed(42)
    model = nn.Linear(mlp_dim, mlp_dim, bias=False)
    A.fully_shard(model, reshard_after_forward=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = model.state_dict()
    tc.assertIsInstance(model.weight, DTensor)
    if not mutate_after_state_dict:
        tc.assertTrue(
            sd["weight"]._local_tensor.untyped_storage().data_ptr()
            == model.weight._local_tensor.untyped_storage().data_ptr()
        )
    else:
        # The original moves to CPU and back to CUDA; on CPU, a dtype round trip reallocates.
        model = model.to(torch.float64).to(torch.float32)
        tc.assertTrue(
            sd["weight"]._local_tensor.untyped_storage().data_ptr()
            != model.weight._local_tensor.untyped_storage().data_ptr()
        )
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.rand(mlp_dim, mlp_dim)
    for _ in range(5):
        optim.zero_grad()
        model(inp).sum().backward()
        optim.step()
        if not mutate_after_state_dict:
            tc.assertTrue(
                sd["weight"]._local_tensor.untyped_storage().data_ptr()
                == model.weight._local_tensor.untyped_storage().data_ptr()
            )


@pytest.mark.parametrize("mutate_after_state_dict", [True, False])
@pytest.mark.parametrize("mlp_dim", [2, 3, 4, 5])
def test_cached_state_dict(dist_run, impl, mlp_dim, mutate_after_state_dict):
    dist_run(_cached_state_dict, 2, impl, mlp_dim, mutate_after_state_dict, timeout=T)


def _meta_load_state_dict_assign(impl, offload_policy):
    """The original's test_dp_state_dict_cpu_offload (and without offload): load DTensors
    built with ``distribute_tensor`` into a meta-initialised model with ``assign=True`` in
    pieces (``strict=False``), then run forward."""
    from torch.distributed.tensor import distribute_tensor

    A = api(impl)
    mlp_dim = 4
    torch.manual_seed(42)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(mlp_dim, mlp_dim, bias=False), nn.Linear(mlp_dim, mlp_dim, bias=False))
    for module in model:
        A.fully_shard(module, offload_policy=offload_policy)
    A.fully_shard(model, offload_policy=offload_policy)
    state_dicts, full = [], {}
    for name, dtensor in model.named_parameters():
        full[name] = torch.randn(dtensor.size())
        dist.broadcast(full[name], src=0)
        state_dicts.append({name: distribute_tensor(full[name], dtensor.device_mesh, dtensor.placements)})
    for sd in state_dicts:
        model.load_state_dict(sd, assign=True, strict=False)
    inp = torch.rand((mlp_dim, mlp_dim))
    out = model(inp).sum()
    tc.assertEqual(out, (inp @ full["0.weight"].T @ full["1.weight"].T).sum())
    for name, dtensor in model.state_dict().items():
        tc.assertEqual(dtensor.device.type, "cpu")
        tc.assertEqual(dtensor.full_tensor(), full[name])


@pytest.mark.parametrize("offload_policy", [OffloadPolicy(), CPUOffloadPolicy(pin_memory=False)], ids=["none", "cpu"])
def test_meta_load_state_dict_assign(dist_run, impl, offload_policy):
    dist_run(_meta_load_state_dict_assign, 2, impl, offload_policy, timeout=T)


def _rank0_offload_full_state_dict(impl):
    A = api(impl)
    rank = dist.get_rank()
    model_args = ModelArgs(dropout_p=0.0)
    torch.manual_seed(42)
    ref_model = Transformer(model_args)
    for param in ref_model.parameters():
        dist.broadcast(param.detach(), src=0)
    model = copy.deepcopy(ref_model)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            A.fully_shard(module)
    A.fully_shard(model)
    sharded_sd = model.state_dict()
    ref_full_sd = {k: v.cpu() for k, v in ref_model.state_dict().items()} if rank == 0 else None
    full_sd = {}
    for name, sharded_param in sharded_sd.items():
        full_param = sharded_param.full_tensor()
        if rank == 0:
            full_sd[name] = full_param.cpu()
    if rank == 0:
        tc.assertEqual(len(full_sd), len(ref_full_sd))
        tc.assertEqual(list(full_sd.keys()), list(ref_full_sd.keys()))
        for param, ref_param in zip(full_sd.values(), ref_full_sd.values(), strict=True):
            tc.assertEqual(param.device, torch.device("cpu"))
            tc.assertEqual(param, ref_param)
    else:
        tc.assertEqual(len(full_sd), 0)


def test_rank0_offload_full_state_dict(dist_run, impl):
    dist_run(_rank0_offload_full_state_dict, 2, impl, timeout=T)

"""fully_shard composed with torch's other composable APIs (FSDP2), on CPU/gloo:
test_replicate.py's ``test_replicate_fully_shard_init`` (``torch.distributed._composable.replicate``
over a model whose submodules are units) and the FSDP2-based
``replicate_with_fsdp.replicate`` over such a model, and test_fully_shard_comm.py's
``TestFullyShardUnshardMultiProcess.test_unshard_async`` (explicit ``unshard(async_op=True)``
inside a replicated model's forward, overlapped with a user all-reduce), and
fsdp/test_fully_shard_compose.py's ``test_replicate_and_fully_shard`` (``replicate`` on a
submodule, ``fully_shard`` on a module above it: the unit leaves the replicated subtree out).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.testing._internal.common_dist_composable import CompositeModel, CompositeParamModel
from torch.testing._internal.common_fsdp import MLP

from ._compat import api, tc

T = 180


# -- test_replicate.py: ReplicateFullyShardInit ------------------------------------------------


class _ToyModel(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linears = nn.Sequential(
            nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        )
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor):
        return self.proj(self.linears(x))


def _replicate_fully_shard_init(impl):
    A = api(impl)
    dim, bz = 3, 2
    model = _ToyModel(dim)
    for linear in model.linears:
        A.fully_shard(linear)
    A.fully_shard(model.linears)
    replicate(model, device_id=torch.device("cpu"))
    for linear in model.linears:
        tc.assertTrue(isinstance(linear.weight, DTensor))
    inp = torch.rand(bz, dim)
    # trigger lazy init
    model(inp).sum()
    for linear in model.linears:
        tc.assertTrue(isinstance(linear.weight, DTensor))


def test_replicate_fully_shard_init(dist_run, impl):
    dist_run(_replicate_fully_shard_init, 2, impl, timeout=T)


# -- fsdp/test_fully_shard_compose.py: test_replicate_and_fully_shard ----------------------------


def _replicate_and_fully_shard(impl, config: str):
    """Each comma is a level of the module tree, bottom-up; 'r' is ``replicate``, 'fm'
    ``fully_shard`` applied by hand. The original computes both models' losses without
    comparing them; here they are compared (FSDP2 gives the replicated reference's)."""
    A = api(impl)
    cpu = torch.device("cpu")
    torch.manual_seed(42)
    if config == "1fm,1r":
        model = CompositeModel(device=cpu)
        ref_model = copy.deepcopy(model)
        A.fully_shard(model.l1)
        replicate(model, device_id=cpu)
    elif config == "1r,1fm":
        model = CompositeParamModel(cpu)
        ref_model = copy.deepcopy(model)
        replicate(model.u1, device_id=cpu)
        A.fully_shard(model)
    elif config == "1r1fm,1fm":
        model = CompositeParamModel(cpu)
        ref_model = copy.deepcopy(model)
        replicate(model.u1, device_id=cpu)
        A.fully_shard(model.u2)
        A.fully_shard(model)
    else:  # "1fm1fm,1r1r,1fm"
        model = CompositeParamModel(cpu)
        ref_model = copy.deepcopy(model)
        A.fully_shard(model.u1.seq)
        A.fully_shard(model.u2.seq)
        replicate(model.u1, device_id=cpu)
        replicate(model.u2, device_id=cpu)
        A.fully_shard(model)
    replicate(ref_model, device_id=cpu)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(dist.get_rank() + 42)
    inp = torch.randn((2, 100))
    for iter_idx in range(10):
        losses: list[torch.Tensor] = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


@pytest.mark.parametrize("config", ["1fm,1r", "1r,1fm", "1r1fm,1fm", "1fm1fm,1r1r,1fm"])
def test_replicate_and_fully_shard(dist_run, impl, config):
    dist_run(_replicate_and_fully_shard, 2, impl, config, timeout=T)


# -- test_fully_shard_comm.py: TestFullyShardUnshardMultiProcess ------------------------------


class _ReduceModule(nn.Module):
    def __init__(self, dim: int, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor):
        y = F.relu(x @ self.weight)
        # NOTE: This all-reduce is not differentiable and is included
        # to exercise the overlap.
        work = dist.all_reduce(y, group=self.mesh.get_group(), async_op=True)
        return y, work


class _MLPs(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mlp1 = MLP(dim)
        self.mlp2 = MLP(dim)
        self.mlp3 = MLP(dim)

    def forward(self, ys: list[torch.Tensor], works: list[dist.Work]):
        (y1, y2, y3), (work1, work2, work3) = ys, works
        work1.wait()
        z1 = self.mlp1(y1)
        work2.wait()
        z2 = self.mlp2(y2)
        work3.wait()
        z3 = self.mlp3(y3)
        return z1 + z2 + z3


class _ReduceModel(nn.Module):
    def __init__(self, dim: int, mesh: DeviceMesh):
        super().__init__()
        self.reduce_module1 = _ReduceModule(dim, mesh)
        self.reduce_module2 = _ReduceModule(dim, mesh)
        self.reduce_module3 = _ReduceModule(dim, mesh)
        self.mlps = _MLPs(dim)

    def forward(self, x: torch.Tensor):
        y1, work1 = self.reduce_module1(x)
        if isinstance(self.mlps.mlp1, FSDPModule):
            self.mlps.mlp1.unshard(async_op=True)
        y2, work2 = self.reduce_module2(x)
        if isinstance(self.mlps.mlp2, FSDPModule):
            self.mlps.mlp2.unshard(async_op=True)
        y3, work3 = self.reduce_module3(x)
        if isinstance(self.mlps.mlp3, FSDPModule):
            self.mlps.mlp3.unshard(async_op=True)
        return self.mlps([y1, y2, y3], [work1, work2, work3])


def _unshard_async(impl):
    A = api(impl)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    batch_size, dim = 2, 8
    torch.manual_seed(42)
    ref_model = replicate(_ReduceModel(dim, mesh))
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    torch.manual_seed(42)
    model = _ReduceModel(dim, mesh)
    A.fully_shard(model.mlps.mlp1, reshard_after_forward=False)
    A.fully_shard(model.mlps.mlp2, reshard_after_forward=False)
    A.fully_shard(model.mlps.mlp3, reshard_after_forward=False)
    A.fully_shard(model.mlps)
    replicate(model.to("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn((batch_size, dim))
    for _ in range(10):
        losses: list[torch.Tensor] = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            losses.append(_model(inp).sum())
            losses[-1].backward()
            with implicit_replication():
                _optim.step()
            _optim.zero_grad()
        tc.assertEqual(losses[0], losses[1])


def test_unshard_async(dist_run, impl):
    dist_run(_unshard_async, 2, impl, timeout=T)


# -- replicate_with_fsdp.replicate (FSDP2-based DDP) over units ---------------------------------


def _replicate_with_fsdp_over_units(impl):
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_with_fsdp

    A = api(impl)
    torch.manual_seed(42)
    model = _ToyModel(8)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for linear in model.linears:
        A.fully_shard(linear)
    A.fully_shard(model.linears)
    replicate_with_fsdp(model)
    for linear in model.linears:
        tc.assertIsInstance(linear.weight, DTensor)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    for _ in range(5):
        inp = torch.randn((2, 8))
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        for param in ref_model.parameters():
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())
        ref_optim.step()
        ref_optim.zero_grad()
        loss = model(inp).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        tc.assertEqual(ref_loss, loss)
    for (name, ref_param), param in zip(ref_model.named_parameters(), model.parameters()):
        tc.assertEqual(ref_param, param.full_tensor(), msg=name)


def test_replicate_with_fsdp_over_units(dist_run, impl):
    dist_run(_replicate_with_fsdp_over_units, 2, impl, timeout=T)

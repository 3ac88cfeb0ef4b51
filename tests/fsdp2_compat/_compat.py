"""What every compatibility case shares: the implementation switch and FSDP2's test helpers.

The cases are PyTorch's own FSDP2 tests (test/distributed/_composable/fsdp/ for torch
2.13), re-expressed as worker functions for our gloo harness. The helpers they use
(``MLP``, ``Transformer``, ``check_sharded_parity``, ``TestCase.assertEqual`` with its
default tolerances) are imported from the installed torch's test utilities, not copied, so
the assertions are FSDP2's own.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_utils import TestCase

__all__ = ["api", "tc", "broadcast_params", "allreduce_avg_grads", "state_dict_save_load"]


def api(impl: str) -> types.SimpleNamespace:
    """``fully_shard`` and its companions from torch (``"torch"``) or from us (``"vescale"``).

    ``FSDPModule`` is torch's class for both: user code and libraries check against it, and so
    are the handle classes (``GradientReductionHandle``: torch 2.15 on, ``None`` before).
    """
    from torch.distributed import fsdp

    if impl == "torch":
        return types.SimpleNamespace(
            fully_shard=fsdp.fully_shard,
            FSDPModule=fsdp.FSDPModule,
            register_fsdp_forward_method=fsdp.register_fsdp_forward_method,
            UnshardHandle=fsdp.UnshardHandle,
            GradientReductionHandle=getattr(fsdp, "GradientReductionHandle", None),
        )
    if impl == "vescale":
        import vescale_plugins

        return types.SimpleNamespace(
            fully_shard=vescale_plugins.fully_shard,
            FSDPModule=fsdp.FSDPModule,
            register_fsdp_forward_method=vescale_plugins.register_fsdp_forward_method,
            UnshardHandle=fsdp.UnshardHandle,
            GradientReductionHandle=getattr(fsdp, "GradientReductionHandle", None),
        )
    raise ValueError(f"unknown fsdp impl {impl!r}")


class _Asserts(TestCase):
    def runTest(self) -> None:  # unittest wants a test method to construct a case
        pass


tc = _Asserts()


def broadcast_params(module: torch.nn.Module) -> None:
    """Rank 0's values everywhere (the originals do this where seeds are per process)."""
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p, src=0)


def allreduce_avg_grads(module: torch.nn.Module) -> None:
    """``all_reduce(grad, AVG)`` as SUM then divide: gloo has no AVG (same for both impls)."""
    world_size = dist.get_world_size()
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


def state_dict_save_load(model: torch.nn.Module, impl: str) -> None:
    """``test_fully_shard_state_dict.py``'s ``_test_state_dict_save_load``: the sharded state
    dict holds the parameters' own storage and loads in place (shared by the 1-D, DP x TP and
    HSDP x TP cases)."""
    rank = dist.get_rank()
    for name, param in model.named_parameters():
        tc.assertIsInstance(param, DTensor, f"{name} is {type(param)}")
    old_fill_value, new_fill_value = 1, 42 + rank
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(old_fill_value)
    name_to_data_ptr = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    ref_sharded_sizes = [p.size() for p in model.parameters()]
    state_dict = model.state_dict()
    for param, ref_size in zip(model.parameters(), ref_sharded_sizes):
        tc.assertEqual(param.size(), ref_size)
        tc.assertTrue(isinstance(param, nn.Parameter))
    tc.assertEqual(set(state_dict.keys()), set(name_to_data_ptr.keys()))
    for name, tensor in state_dict.items():
        tc.assertTrue(isinstance(tensor, DTensor))
        if name_to_data_ptr[name] == 0:
            if impl == "torch":  # only trailing ranks are empty under FSDP2's Shard(0) (README)
                tc.assertGreater(rank, 0)
            tc.assertEqual(torch.count_nonzero(tensor.to_local()).item(), 0)
        else:
            tc.assertEqual(tensor.to_local().data_ptr(), name_to_data_ptr[name])
    new_state_dict = {n: t.detach().clone().fill_(new_fill_value) for n, t in state_dict.items()}
    for param in model.parameters():
        tc.assertEqual(param.to_local(), torch.ones_like(param.to_local()) * old_fill_value)
    model.load_state_dict(new_state_dict)
    for name, param in model.named_parameters():
        tc.assertEqual(param.to_local(), torch.ones_like(param.to_local()) * new_fill_value)
        local = param.to_local()
        if local.size(0) * param.device_mesh.size() == param.size(0):
            tc.assertEqual(local.data_ptr(), name_to_data_ptr[name])

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
from torch.testing._internal.common_utils import TestCase

__all__ = ["api", "tc", "broadcast_params", "allreduce_avg_grads"]


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

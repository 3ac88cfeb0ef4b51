"""Data-dependent routing (a mixture-of-experts-like layer) and the gradients DDP gives it."""

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.support.models import loss_fn


class RoutedExperts(nn.Module):
    """A mixture-of-experts-like layer: the data picks one expert per batch (its first token)."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, h: torch.Tensor, route: int) -> torch.Tensor:
        return h + self.experts[route](h)


def ddp_backward(reference: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, per_rank: int) -> None:
    """DDP's gradient on one process: each rank's rows of the global batch, its loss divided
    by the world size."""
    world = dist.get_world_size()
    for r in range(world):
        rows = slice(r * per_rank, (r + 1) * per_rank)
        (loss_fn(reference(tokens[rows]), targets[rows]) / world).backward()


def assert_ddp_gradients(model: nn.Module, reference: nn.Module) -> None:
    """``grad=None`` where DDP has none (no rank's data reached it), else DDP's gradient."""
    for name, ref_param in reference.named_parameters():
        param = model.get_parameter(name)
        if ref_param.grad is None:
            assert param.grad is None, name
        else:
            assert param.grad is not None, (name, "no gradient on rank", dist.get_rank())
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6)

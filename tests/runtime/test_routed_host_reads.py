"""A routed backward reads the presence flags back to the host once, for every unit: a
parameter no rank's batch reached keeps ``grad=None``, one another rank's batch reached
gets the reduced gradient, as under DDP."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.models import batch, clone, loss_fn
from tests.support.routed import RoutedExperts, assert_ddp_gradients, ddp_backward
from vescale_plugins import fully_shard

PER_RANK = 2


class _TwiceRouted(torch.nn.Module):
    """Two expert layers (two units); a batch goes to expert ``first token % 3`` in both."""

    def __init__(self, vocab=101, dim=8, experts=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.moe = torch.nn.ModuleList(RoutedExperts(dim, experts) for _ in range(2))
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        route = int(tokens[0, 0]) % 3
        h = self.embed(tokens)
        for layer in self.moe:
            h = layer(h, route)
        return self.out(h)


class _HostReads(TorchDispatchMode):
    """Counts scalar reads of tensors (``item``, ``bool``) and ``tolist`` calls."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            self.count += 1
            return self._tolist(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _routed_backward_reads():
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _TwiceRouted()
    model = clone(reference)
    for layer in model.moe:
        fully_shard(layer)
    fully_shard(model)
    tokens, targets = batch(0, world, PER_RANK)
    for r in range(world):  # rank r's batch goes to expert r % 3: at W=2 expert 2 gets none
        tokens[r * PER_RANK, 0] = r
    ddp_backward(reference, tokens, targets, PER_RANK)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss = loss_fn(model(tokens[rows]), targets[rows])
    with _HostReads() as reads:
        loss.backward()
    assert_ddp_gradients(model, reference)
    return reads.count


@pytest.mark.parametrize("world", [2, 3])
def test_a_routed_backward_reads_the_flags_once(dist_run, world):
    """Every rank lacks the other ranks' experts in both expert units: one read, not one per
    unit."""
    assert dist_run(_routed_backward_reads, world) == [1] * world

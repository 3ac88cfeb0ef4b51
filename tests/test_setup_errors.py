"""Set-up mistakes that used to fail late or inside torch: now one clear error on every rank.

Also zero-size parameters, which FSDP2 accepts: they shard (to nothing) and train alongside
the others exactly as under FSDP2.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from vescale_plugins import fully_shard
from vescale_plugins import PlanMismatchError


class WithEmpty(nn.Module):
    """A model with zero-size parameters (an empty prefix table, a zero-width adapter)."""

    def __init__(self, use_empty: bool) -> None:
        super().__init__()
        self.use_empty = use_empty
        self.first = nn.Linear(6, 5)
        self.empty_rows = nn.Parameter(torch.empty(0, 5))
        self.empty_cols = nn.Parameter(torch.empty(5, 0))
        self.second = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.use_empty:  # gradients of zero elements (FSDP2's backward refuses these)
            h = h + self.empty_rows.sum() + (h @ self.empty_cols).sum()
        return self.second(h)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _train(shard, use_empty, steps=2):
    torch.manual_seed(0)
    model = WithEmpty(use_empty)
    if shard is None:  # the unsharded reference: the mean of every rank's loss
        losses = lambda step: torch.stack([model(_batch(step, r)).square().mean() for r in range(dist.get_world_size())]).mean()
    else:
        shard(model.first)
        shard(model)
        losses = lambda step: model(_batch(step, dist.get_rank())).square().mean()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(steps):
        losses(step).backward()
        opt.step()
        opt.zero_grad()
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for name, p in model.named_parameters()}


def _assert_same(ours, theirs):
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    assert ours["empty_rows"].shape == (0, 5) and ours["empty_cols"].shape == (5, 0)


def _zero_size_parameters_match_fsdp2_and_unsharded():
    _assert_same(_train(fully_shard, use_empty=False), _train(torch_fully_shard, use_empty=False))
    _assert_same(_train(fully_shard, use_empty=True), _train(None, use_empty=True))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_zero_size_parameters_train_like_fsdp2(dist_run, world):
    dist_run(_zero_size_parameters_match_fsdp2_and_unsharded, world)


def _child_after_parent():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\): its parameter 'weight' is already sharded .* bottom-up"):
        fully_shard(model[0])


def _process_group_as_mesh():
    with pytest.raises(TypeError, match=r"got a ProcessGroup; pass a DeviceMesh: .*DeviceMesh.from_group"):
        fully_shard(nn.Linear(4, 4), mesh=dist.group.WORLD)


def _mesh_without_this_rank():
    mesh = DeviceMesh("cpu", [0])  # every rank builds it (a collective), only rank 0 is in it
    model = nn.Linear(4, 4)
    if dist.get_rank() == 0:
        fully_shard(model, mesh=mesh)
        return
    with pytest.raises(ValueError, match=rf"global rank {dist.get_rank()}\) is not in the mesh \[0\]"):
        fully_shard(model, mesh=mesh)
    assert not isinstance(model.weight, DTensor)


def _rank_dependent_block_size_fn():
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    # 2 rows on rank 0, 4 on the others: each answer is valid on its own rank.
    with pytest.raises(PlanMismatchError, match=r"parameter '0.weight': rank 0 has shape \(8, 4\), torch.float32, blocks of 2 rows; rank 1 has .* blocks of 4 rows; block_size_fn"):
        fully_shard(model, block_size_fn=lambda name, p: (2 if rank == 0 else 4) if name == "0.weight" else None)
    assert not isinstance(model[0].weight, DTensor)
    # An answer that is invalid on one rank only: every rank raises that rank's error.
    with pytest.raises(ValueError, match=r"block_size_fn\('0.weight'\) returned 0"):
        fully_shard(model, block_size_fn=lambda name, p: (0 if rank == 1 else None) if name == "0.weight" else None)
    # Nothing was left half-done: the same model still shards and runs.
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model(torch.ones(1, 4)).sum().backward()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "body", [_child_after_parent, _process_group_as_mesh, _mesh_without_this_rank, _rank_dependent_block_size_fn]
)
def test_setup_error_on_every_rank_before_any_collective(dist_run, body):
    dist_run(body, 2, timeout=60)

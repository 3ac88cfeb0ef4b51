"""Units split into several DBuffers (the planner's choice under the ring cost model) train
exactly like the unsharded model and like FSDP2, and the run record shows the buffers."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from vescale_plugins import BufferSplitCost, fully_shard
from vescale_plugins.observe.record import record_run

STEPS = 4
TOL = dict(rtol=2e-5, atol=2e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)


class SplitMLP(nn.Module):
    """``block`` ([13, 40] and [14, 13] weights with biases) pads less as two buffers than as
    one at W=2 and W=3: 1-row blocks of 40 and 13 elements force an lcm in one buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(40, 13), nn.Tanh(), nn.Linear(13, 14))
        self.head = nn.Linear(14, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _shard(model, shard, **kwargs):
    shard(model.block, **kwargs)
    shard(model, **kwargs)
    return model


def _batch(step: int, world: int, per_rank: int = 4):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * per_rank, 40, generator=g), torch.randint(0, 3, (world * per_rank,), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _reference_step(model, x, y, world, per_rank=4):
    """DDP's gradient on one process: each rank's backward, summed in rank order, averaged
    (what every sharded rank computes, bit for bit, up to the order of the W-term sum)."""
    params = list(model.parameters())
    grads, losses = [torch.zeros_like(p) for p in params], []
    for r in range(world):
        rows = slice(r * per_rank, (r + 1) * per_rank)
        loss = _loss(model, x[rows], y[rows])
        for g, d in zip(grads, torch.autograd.grad(loss, params)):
            g += d
        losses.append(loss.detach())
    for p, g in zip(params, grads):
        p.grad = g / world
    return torch.stack(losses).sum() / world


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _multi_buffer_parity():
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = SplitMLP()
    # Split wherever it saves padding. One-row blocks asked for: with none asked, one buffer
    # cut element-wise pads as little (tests/runtime/test_elementwise_shards.py).
    ours = _shard(
        copy.deepcopy(reference),
        fully_shard,
        buffer_split_cost=BufferSplitCost(alpha_s=0.0),
        block_size_fn=lambda name, p: 1,
    )
    theirs = _shard(copy.deepcopy(reference), torch_fully_shard)
    unit = ours.block._vescale_fsdp_unit
    assert len(unit.dbuffers) == 2, [b.layout for b in unit.dbuffers]
    # Each buffer is its own collective: 2 gathers + 2 reduce-scatters for the block.
    opts = [_adamw(m) for m in (reference, ours, theirs)]
    for step in range(STEPS):
        x, y = _batch(step, world)
        ref_loss = _reference_step(reference, x, y, world)
        mine = slice(rank * 4, (rank + 1) * 4)
        losses = []
        for model in (ours, theirs):
            loss = _loss(model, x[mine], y[mine])
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total / world)
        torch.testing.assert_close(losses[0], ref_loss, **TOL)
        torch.testing.assert_close(losses[0], losses[1], **TOL)
        for (name, p), (_, q), (_, r) in zip(
            ours.named_parameters(), theirs.named_parameters(), reference.named_parameters(), strict=True
        ):
            torch.testing.assert_close(
                p.grad.full_tensor(), r.grad, **TOL, msg=lambda m: f"grad {name} vs unsharded: {m}"
            )
            torch.testing.assert_close(
                p.grad.full_tensor(), q.grad.full_tensor(), **TOL, msg=lambda m: f"grad {name} vs FSDP2: {m}"
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), (_, q), (_, r) in zip(
            ours.named_parameters(), theirs.named_parameters(), reference.named_parameters(), strict=True
        ):
            torch.testing.assert_close(
                p.full_tensor(), r.detach(), **PARAM_TOL, msg=lambda m: f"param {name} vs unsharded: {m}"
            )
            torch.testing.assert_close(
                p.full_tensor(), q.full_tensor(), **PARAM_TOL, msg=lambda m: f"param {name} vs FSDP2: {m}"
            )

    with record_run(ours, opts[1]) as record:
        x, y = _batch(STEPS, world)
        _loss(ours, x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]).backward()
        record.mark_step()
    units = {tuple(u["modules"]): u for u in record.to_dict()["sharding"]["units"]}
    block = units[("block",)]
    assert block["buffers"] == 2
    assert len(block["shard_elements_per_rank"]) == 2
    named = [n for names in block["buffer_parameters"] for n in names]
    assert sorted(named) == sorted(p.fqn for p in unit.fsdp_params), block["buffer_parameters"]
    assert len(named) == 4, block["buffer_parameters"]
    assert all(block["buffer_parameters"]), block["buffer_parameters"]
    assert units[("",)]["buffers"] == 1
    assert "2 buffer(s)" in record.summary()
    summary = record.to_dict()["communication"]["summary"]
    # Two buffers in the block: two reduce-scatters for it, one for the root.
    assert summary["reduce_scatter"]["count_per_step"] == 3, summary


@pytest.mark.parametrize("world", [2, 3])
def test_split_unit_trains_like_unsharded_and_fsdp2(dist_run, world):
    dist_run(_multi_buffer_parity, world)


def _default_cost_keeps_one_buffer():
    model = _shard(SplitMLP(), fully_shard)
    assert len(model.block._vescale_fsdp_unit.dbuffers) == 1
    never_split = BufferSplitCost(max_buffers=1, alpha_s=0.0)
    assert len(_shard(SplitMLP(), fully_shard, buffer_split_cost=never_split).block._vescale_fsdp_unit.dbuffers) == 1


def test_default_cost_keeps_one_buffer_on_small_units(dist_run):
    dist_run(_default_cost_keeps_one_buffer, 3)


def test_split_cost_rejects_nonsense():
    with pytest.raises(ValueError, match="max_buffers"):
        BufferSplitCost(max_buffers=0)
    with pytest.raises(ValueError, match="alpha_s"):
        BufferSplitCost(alpha_s=-1.0)

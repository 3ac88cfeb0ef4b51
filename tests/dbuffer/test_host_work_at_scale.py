"""Host work per step does not grow with the world size (torch's fake process group: one
process plays rank 0 of a W-rank job, collectives move no data)."""

import functools
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.fake_world import fake_world
from vescale_plugins import fully_shard


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    """Shapes that span many ranks' chunks at large W, and a 1-D weight as the root's norm."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 96), nn.Linear(96, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@functools.cache
def _ops_per_step(world_size):
    """Ops of one forward and backward at ``world_size`` (the parameters' gradients accumulate
    from the steps before), counted once per world size for every test here."""
    return _step_at(world_size)[0]


@functools.cache
def _step_at(world_size):
    """(ops of a steady-state forward and backward, whether every sharded gradient is a
    DTensor over its parameter's own spec) at ``world_size``."""
    with fake_world(world_size) as mesh:
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block())
        model.register_parameter("scale", nn.Parameter(torch.ones(64)))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(4, 64)
        for _ in range(2):
            (model(x) * model.scale).sum().backward()
        counter = _Ops()
        with counter:
            (model(x) * model.scale).sum().backward()
        shared_specs = [p.grad is not None and p.grad._spec is p._spec for p in model.parameters()]
        return counter.counts, shared_specs


@pytest.mark.distributed
def test_gradient_copy_in_is_a_few_ops_per_parameter_at_any_world_size():
    small, large = _ops_per_step(8), _ops_per_step(1024)
    assert sum(large.values()) <= 1.1 * sum(small.values()), (small, large)


@pytest.mark.distributed
def test_presence_flags_are_filled_on_the_device_not_copied_from_the_host():
    counts = _ops_per_step(8)
    assert "aten::lift_fresh" not in counts, counts
    assert "aten::_to_copy" not in counts, counts


@pytest.mark.distributed
def test_gradient_release_issues_one_copy_per_buffer_and_no_profiler_scopes():
    # Two blocks and the root: three gradient buffers, each filled by one _foreach_copy_ of
    # every gradient piece (one launch per buffer, as FSDP2's one chunk-cat per unit), not one
    # copy_ per piece. With no profiler running, the library's scopes dispatch nothing.
    counts = _ops_per_step(1024)
    assert counts["aten::_foreach_copy_"] == 3, counts
    assert not [op for op in counts if op.startswith("profiler::")], counts


@pytest.mark.distributed
def test_sharded_gradients_reuse_their_parameters_dtensor_spec():
    # As FSDP2 builds its gradients from the parameter's cached sharding spec: no DTensorSpec
    # (placements, tensor meta, hash) made per gradient per step.
    _, shared = _step_at(1024)
    assert shared, shared
    assert all(shared), shared

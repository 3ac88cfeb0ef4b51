"""Every rank's chunk of every collective buffer starts 16 bytes aligned, in every dtype the
buffer is gathered, reduced or stored in (torch's fake process group: no data moves)."""

import itertools

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.support.fake_world import fake_world
from vescale_plugins import fully_shard

_ODD_SHAPES = [(7, 3), (5,), (11, 13), (1,), (3, 5, 2)]
_POLICIES = [
    (torch.float32, None, None),
    (torch.float32, torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16, None),
    (torch.bfloat16, None, torch.float32),
]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [3, 8])
def test_every_rank_chunk_is_16_byte_aligned(world_size):
    with fake_world(world_size) as mesh:
        for (dtype, param_dtype, reduce_dtype), count in itertools.product(_POLICIES, (1, 3, 5)):
            module = nn.Module()
            for i, shape in enumerate(_ODD_SHAPES[:count]):
                module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(shape, dtype=dtype)))
            fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))
            for dbuffer in module._vescale_fsdp_unit.dbuffers:
                for chunk, dtype_in_use in (
                    (dbuffer.shard_size, dbuffer.dtype),
                    (dbuffer.shard_size, dbuffer.param_dtype),
                    (dbuffer.grad_shard_size, dbuffer.reduce_dtype),
                ):
                    assert chunk * dtype_in_use.itemsize % 16 == 0, (dtype, param_dtype, reduce_dtype, count)

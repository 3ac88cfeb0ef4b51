"""torch's fake process group: this process plays rank 0 of a W-rank job, collectives move
no data (what torch uses for its own scale tests)."""

import contextlib

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world_size):
    """A 1-D CPU mesh over a fake group of ``world_size`` ranks, destroyed on exit."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh: DeviceMesh = init_device_mesh("cpu", (world_size,))
        yield mesh
    finally:
        dist.destroy_process_group()

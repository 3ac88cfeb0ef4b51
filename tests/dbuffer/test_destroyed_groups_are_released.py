"""Nothing of ours keeps a process group (and its gloo threads) alive past ``destroy_process_group``.

A group still referenced at interpreter exit is torn down during finalization, in no fixed
order with the rest of the runtime: the cause of the occasional ``terminate called without an
active exception`` (SIGABRT) after a run's work was done.
"""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from vescale_plugins.dbuffer.collectives import all_gather_into, reduce_scatter_into, uses_point_to_point


def _group_is_freed_after_destroy():
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    assert uses_point_to_point(group, torch.device("cpu"))
    gathered = torch.empty(3 * world)
    all_gather_into(gathered, torch.full((3,), float(dist.get_rank())), group)
    reduced = torch.empty(3)
    reduce_scatter_into(reduced, torch.ones(3 * world), group)
    assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(3))
    assert torch.equal(reduced, torch.full((3,), float(world)))
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert alive() is None, "a process group outlived destroy_process_group"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_in_place_collectives_do_not_keep_a_destroyed_group_alive(dist_run, world):
    dist_run(_group_is_freed_after_destroy, world, timeout=300)

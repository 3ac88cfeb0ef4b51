"""Meta-device init of a sharded model: what ``to_empty()`` and ``reset_parameters()`` hold, and
whose generator the values come from.

Neither step may hold a full parameter or a whole unit: live bytes during ``to_empty()`` stay
within this rank's shards (every unit's new sharded buffer, plus the unit being moved held
twice while its shards move in) and during ``reset_parameters()`` within the random draw's
piece, counted by the allocator's own events (``observe.allocations``).

The values are the unsharded model's under rank 0's generator state whatever the other ranks
seeded, and every rank's generator ends where the unsharded draw leaves it (what DTensor's RNG
tracker gives FSDP2 on GPU; FSDP2 on CPU draws each shard from the rank's own generator, so
the reference is the unsharded model, not FSDP2).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import vescale_plugins.ragged.dtensor.random_init as random_init
from tests.support.models import make_decoder
from tests.support.parity import EXACT, assert_matches, shard_decoder
from vescale_plugins.observe.allocations import AllocationTracker

# Bytes of small tensors the steps make besides shards (the generator state the first draw
# exchanges, 5056 B on CPU, and layout bookkeeping): below one unit of the test decoder (about
# 50 KB in fp32) and its largest parameter (15552 B).
SMALL = 8192
PIECE = 64  # elements per random piece, so every weight spans many pieces


def _units(model):
    return {id(m._vescale_fsdp_unit): m._vescale_fsdp_unit for m in model.modules() if hasattr(m, "_vescale_fsdp_unit")}


def _sharded_bytes(unit):
    return sum(d.sharded.numel() * d.sharded.element_size() for d in unit.dbuffers)


def _meta_decoder(mesh_shape):
    """The test decoder built on meta and sharded (over a (replicate, shard) mesh if given)."""
    with torch.device("meta"):
        model = make_decoder()
    if mesh_shape is None:
        return shard_decoder(model)
    return shard_decoder(model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")))


def _meta_init(mesh_shape):
    unsharded = make_decoder()
    torch.manual_seed(7)
    unsharded.reset_parameters()
    next_draw = torch.rand(5)
    default_piece, random_init._RANDOM_PIECE = random_init._RANDOM_PIECE, PIECE
    try:
        model = _meta_decoder(mesh_shape)
        with AllocationTracker() as tracker:
            with tracker.region("to_empty"):
                model.to_empty(device="cpu")
            with tracker.region("reset_parameters"):
                torch.manual_seed(7 if dist.get_rank() == 0 else 100 + dist.get_rank())
                model.reset_parameters()
    finally:
        random_init._RANDOM_PIECE = default_piece
    # what it holds
    units = [_sharded_bytes(u) for u in _units(model).values()]
    largest_param = max(p.numel() * p.element_size() for p in model.parameters())
    to_empty = tracker.region_memory("to_empty")
    assert to_empty.peak_bytes <= sum(units) + max(units) + SMALL, (to_empty, units)
    reset = tracker.region_memory("reset_parameters")
    drawn = reset.peak_bytes - reset.start_bytes
    assert drawn <= 2 * PIECE * 4 + SMALL < largest_param, (reset, largest_param)
    # whose seed
    assert_matches(model, unsharded, "param", tol=EXACT)
    assert torch.equal(torch.rand(5), next_draw), "every generator must end where the unsharded draw leaves it"


@pytest.mark.parametrize(("world", "mesh_shape"), [(2, None), (3, None), (4, (2, 2))], ids=["W2", "W3", "HSDP2x2"])
def test_meta_init_holds_only_shards_and_takes_rank_zeros_seed(dist_run, world, mesh_shape):
    dist_run(_meta_init, world, mesh_shape, timeout=300)

"""torch.distributed.checkpoint on RaggedShard: save without communication, reload anywhere.

Saved at W=2 with one set of units, loaded at W=3 with another, into Replicate, into plain
full tensors, and the reverse (a full-tensor checkpoint loaded into RaggedShard).
"""

import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from vescale_plugins import RaggedShard, flat_interval_boxes

# name -> (shape, dims, units at W=2, units at W=3); rank 1-3, element/row/block-wise.
TENSORS = {
    "vector": ((12,), (0,), (5, 7), (0, 12, 0)),
    "row_wise": ((6, 5), (0,), (1, 2), (2, 0, 1)),
    "element_wise": ((4, 5), (0, 1), (7, 13), (3, 1, 1)),
    "block_wise": ((8, 2, 3), (0,), (3, 1), (1, 2, 1)),
    "bf16_rows": ((6, 4), (0, 1), (1, 5), (1, 1, 4)),
}


def _reference(name):
    shape = TENSORS[name][0]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    full = torch.randn(shape, generator=g)
    return full.to(torch.bfloat16) if name.startswith("bf16") else full


def _ragged_state(units_index):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for name, (_shape, dims, *units) in TENSORS.items():
        state[name] = distribute_tensor(_reference(name), mesh, [RaggedShard(dims, units[units_index])])
    return state


def _save_at_two(path):
    state = _ragged_state(0)
    dcp.save(state, checkpoint_id=path)
    return {name: [tuple(c.offsets) for c in t.__create_chunk_list__()] for name, t in state.items()}


def _load_at_three(path):
    state = _ragged_state(1)
    for t in state.values():
        t.to_local().zero_()
    dcp.load(state, checkpoint_id=path)
    rank = dist.get_rank()
    for name, t in state.items():
        assert torch.equal(t.to_local(), t.placements[0].split_full(_reference(name), rank)), name
        assert torch.equal(t.full_tensor(), _reference(name)), name


def _load_into_replicate(path):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {name: distribute_tensor(torch.zeros_like(_reference(name)), mesh, [Replicate()]) for name in TENSORS}
    dcp.load(state, checkpoint_id=path)
    for name, t in state.items():
        assert torch.equal(t.to_local(), _reference(name)), name


def test_save_at_two_load_at_three_with_other_units(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    saved_chunks = dist_run(_save_at_two, 2, path)
    dist_run(_load_at_three, 3, path)
    dist_run(_load_into_replicate, 3, path)

    # No communication at save: every rank wrote exactly the boxes of its own flat run.
    metadata = dcp.FileSystemReader(path).read_metadata()
    for name, (shape, dims, units, _) in TENSORS.items():
        layout = RaggedShard(dims, units).layout(shape)
        expected = [[o for o, _ in flat_interval_boxes(shape, s.offset, s.length)] for s in layout.slices]
        assert [chunks[name] for chunks in saved_chunks] == expected
        stored = sorted(tuple(c.offsets) for c in metadata.state_dict_metadata[name].chunks)
        assert stored == sorted(o for per_rank in expected for o in per_rank)
        assert sum(math.prod(c.sizes) for c in metadata.state_dict_metadata[name].chunks) == math.prod(shape)


def test_ragged_checkpoint_loads_into_plain_full_tensors(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    dist_run(_save_at_two, 2, path)
    state = {name: torch.zeros_like(_reference(name)) for name in TENSORS}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for name, t in state.items():
        assert torch.equal(t, _reference(name)), name


def _load_full_checkpoint_into_ragged(path):
    _load_at_three(path)


def test_full_tensor_checkpoint_loads_into_ragged(dist_run, tmp_path):
    path = str(tmp_path / "full")
    dcp.save({name: _reference(name) for name in TENSORS}, checkpoint_id=path, no_dist=True)
    dist_run(_load_full_checkpoint_into_ragged, 3, path)

"""RaggedShard next to tensor/expert-parallel Shards on a (dp, tp) mesh: the DTensor side.

The ragged placement cuts each rank's tensor-parallel shard (StridedRaggedShard where the
TP shard splits its rows). Every DTensor path a trainer uses must see the right global
tensor: full_tensor, redistribute both ways, local shape and offset, norms, optimizer ops,
random init, and DCP across mesh shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from vescale_plugins.ragged.placement import RaggedShard, StridedRaggedShard

pytestmark = pytest.mark.timeout(120)


def _full(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


# (global shape, TP placement, ragged placement on dp); uneven dp units, dp rank 1 holding
# nothing in one case.
CASES = [
    ((8, 6), Shard(0), StridedRaggedShard((0,), (3, 1), split_factor=2)),
    ((6, 8), Shard(1), RaggedShard((0,), (1, 2))),
    ((5, 3), Replicate(), RaggedShard((0,), (4, 1))),
    ((4, 2, 3), Shard(0), StridedRaggedShard((0,), (2, 0), split_factor=2)),
    ((7,), Replicate(), RaggedShard((0,), (5, 2))),
]


def _composed_dtensor_paths():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for shape, tp, ragged in CASES:
        full = _full(shape)
        placements = (ragged, tp)
        d = distribute_tensor(full, mesh, placements)
        # The local tensor is the ragged cut of this rank's TP shard.
        tp_local = distribute_tensor(full, mesh["tp"], [tp]).to_local()
        expected = ragged.split_full(tp_local.contiguous(), mesh.get_local_rank(0))
        assert torch.equal(d.to_local(), expected), (shape, placements)
        torch.testing.assert_close(d.full_tensor(), full)
        # local shape/offset: one box of whole rows for row-wise cuts
        local_shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
        if d.to_local().numel():
            box = full[tuple(slice(o, o + s) for o, s in zip(offset, local_shape))]
            assert torch.equal(box.reshape(d.to_local().shape), d.to_local())
        # to the FSDP2 layout of the same tensor and back
        fsdp2 = d.redistribute(mesh, (Shard(0) if tp != Shard(0) else Replicate(), tp))
        torch.testing.assert_close(fsdp2.full_tensor(), full)
        back = fsdp2.redistribute(mesh, placements)
        assert torch.equal(back.to_local(), d.to_local())
        # another ragged layout on the same TP shards: one all-to-all
        moved_units = tuple(reversed(ragged.local_units)) if sum(ragged.local_units[::-1][:1]) else (1, 1)
        moved = type(ragged)(
            *([ragged.dims, moved_units] + ([ragged.split_factor] if isinstance(ragged, StridedRaggedShard) else []))
        )
        torch.testing.assert_close(d.redistribute(mesh, (moved, tp)).full_tensor(), full)
        # norms (what clip_grad_norm_ computes) and a full reduction
        for ord in (2.0, float("inf"), 1.0):
            torch.testing.assert_close(
                torch.linalg.vector_norm(d, ord).full_tensor(), torch.linalg.vector_norm(full, ord)
            )
        torch.testing.assert_close(torch._foreach_norm([d, d], 2.0)[1].full_tensor(), full.norm())
        torch.testing.assert_close(d.sum().full_tensor(), full.sum())
        # a stock optimizer step on a composed parameter matches the dense one
        param, dense = torch.nn.Parameter(d.clone()), torch.nn.Parameter(full.clone())
        for foreach in (False, True):
            opt, ref = (
                torch.optim.AdamW([param], lr=0.1, foreach=foreach),
                torch.optim.AdamW([dense], lr=0.1, foreach=foreach),
            )
            for step in range(2):
                g = _full(shape, seed=step + 1)
                param.grad, dense.grad = distribute_tensor(g, mesh, placements), g.clone()
                opt.step()
                ref.step()
            torch.testing.assert_close(param.full_tensor(), dense.detach())
        # in-place random init draws the full tensor's values (sharded reset_parameters)
        torch.manual_seed(7)
        reference = torch.empty(shape).uniform_()
        torch.manual_seed(7)
        init = distribute_tensor(torch.zeros(shape), mesh, placements)
        init.uniform_()
        torch.testing.assert_close(init.full_tensor(), reference)


def test_composed_dtensor_paths(dist_run):
    dist_run(_composed_dtensor_paths, 4)


def _wrong_stride_is_refused():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for placements, shape, message in [
        ((RaggedShard((0,), (1, 1)), Shard(0)), (4, 6), "StridedRaggedShard((0,), (1, 1), split_factor=2)"),
        ((StridedRaggedShard((0,), (1, 1), 2), Shard(1)), (4, 6), "use RaggedShard((0,), (1, 1))"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            distribute_tensor(torch.zeros(shape), mesh, placements)
    dist.barrier()


def _uneven_tensor_parallel_shards():
    """TP shards of unequal size (FSDP2's uneven TP): each rank's ragged layout is of its own
    TP shard, so the placement's units differ between TP ranks."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh.get_local_rank(1)
    for shape, tp, units in [
        ((5, 4), Shard(0), [(2, 1), (0, 2)]),
        ((4, 5), Shard(1), [(3, 1), (1, 3)]),
        ((3, 2), Shard(0), [(1, 1), (1, 0)]),
    ]:
        full = _full(shape)
        ragged = StridedRaggedShard((0,), units[tp_rank], 2) if tp == Shard(0) else RaggedShard((0,), units[tp_rank])
        d = distribute_tensor(full, mesh, (ragged, tp))
        tp_local = distribute_tensor(full, mesh["tp"], [tp]).to_local()
        assert torch.equal(d.to_local(), ragged.split_full(tp_local.contiguous(), mesh.get_local_rank(0)))
        torch.testing.assert_close(d.full_tensor(), full)
        torch.testing.assert_close(d.redistribute(mesh, (Replicate(), tp)).to_local(), tp_local)
        torch.testing.assert_close(torch.linalg.vector_norm(d).full_tensor(), full.norm())


def test_uneven_tensor_parallel_shards(dist_run):
    dist_run(_uneven_tensor_parallel_shards, 4)


def test_composition_errors_name_the_fix(dist_run):
    dist_run(_wrong_stride_is_refused, 4)


def _save_composed(path):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dcp.save(
        {f"t{i}": distribute_tensor(_full(s, i), mesh, (r, tp)) for i, (s, tp, r) in enumerate(CASES)},
        checkpoint_id=path,
    )


def _load_on_other_meshes(path):
    # dp=1 x tp=2 with the composed placements, then 4 ranks of plain FSDP2-style Shard(0)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    state = {}
    for i, (s, tp, r) in enumerate(CASES):
        ragged = (
            type(r)(r.dims, (1,), r.split_factor) if isinstance(r, StridedRaggedShard) else RaggedShard(r.dims, (1,))
        )
        state[f"t{i}"] = distribute_tensor(torch.zeros(s), mesh, (ragged, tp))
    dcp.load(state, checkpoint_id=path)
    for i, (s, _, _) in enumerate(CASES):
        torch.testing.assert_close(state[f"t{i}"].full_tensor(), _full(s, i))


def _load_plain(path):
    state = {f"t{i}": torch.zeros(s) for i, (s, _, _) in enumerate(CASES)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return {k: v for k, v in state.items()}


def test_checkpoint_of_composed_tensors_loads_on_other_meshes(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    dist_run(_save_composed, 4, path)
    dist_run(_load_on_other_meshes, 2, path)
    for i, (s, _, _) in enumerate(CASES):
        torch.testing.assert_close(_load_plain(path)[f"t{i}"], _full(s, i))

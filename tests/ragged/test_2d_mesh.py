"""RaggedShard on one dim of a 2-D mesh with Replicate on the other (hybrid-sharding groundwork)."""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, distribute_tensor

from vescale_plugins import RaggedShard

CASES = [((6, 5), (0,), (1, 2)), ((12,), (0,), (0, 12)), ((4, 3, 2), (0, 1), (5, 7)), ((6, 4), (0,), (3, 0))]


def _full(shape, salt=0):
    g = torch.Generator().manual_seed(hash((shape, salt)) % 2**31)
    return torch.randn(shape, generator=g)


def _placements(ragged_mesh_dim, ragged):
    return [ragged, Replicate()] if ragged_mesh_dim == 0 else [Replicate(), ragged]


def _everything_on_a_2d_mesh(ragged_mesh_dim):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    coordinate = mesh.get_local_rank(ragged_mesh_dim)
    for shape, dims, units in CASES:
        full, other = _full(shape), _full(shape, 1)
        ragged = RaggedShard(dims, units)
        placements = _placements(ragged_mesh_dim, ragged)
        d = distribute_tensor(full, mesh, placements)
        assert torch.equal(d.to_local(), ragged.split_full(full, coordinate))
        assert torch.equal(d.full_tensor(), full)

        o = distribute_tensor(other, mesh, placements)
        assert (d + o).placements == tuple(placements)
        assert torch.equal((d + o).full_tensor(), full + other)
        torch.testing.assert_close(torch.linalg.vector_norm(d).full_tensor(), full.norm())
        torch.testing.assert_close(torch.linalg.vector_norm(d, math.inf).full_tensor(), full.abs().max())
        torch.testing.assert_close(d.sum().full_tensor(), full.sum())

        moved_units = (
            tuple(reversed(units))
            if units[0] != units[-1]
            else (1, 1)
            if math.prod(shape[: len(dims)]) % 2 == 0
            else units
        )
        moved = d.redistribute(mesh, _placements(ragged_mesh_dim, RaggedShard(dims, moved_units)))
        assert torch.equal(moved.full_tensor(), full)
        assert torch.equal(d.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full)

        partial_placements = [Partial(), Replicate()] if ragged_mesh_dim == 1 else [Replicate(), Partial()]
        partial_placements[ragged_mesh_dim] = Partial()
        partial_placements[1 - ragged_mesh_dim] = Partial()
        contribution = full / 4
        p = torch.distributed.tensor.DTensor.from_local(
            contribution, mesh, partial_placements, shape=full.shape, stride=full.stride()
        )
        torch.testing.assert_close(p.redistribute(mesh, placements).full_tensor(), full)

        param, dense = torch.nn.Parameter(distribute_tensor(full, mesh, placements)), torch.nn.Parameter(full.clone())
        opt, dense_opt = torch.optim.AdamW([param], lr=0.1), torch.optim.AdamW([dense], lr=0.1)
        for step in range(2):
            g = _full(shape, 10 + step)
            param.grad, dense.grad = distribute_tensor(g, mesh, placements), g.clone()
            got = torch.nn.utils.clip_grad_norm_([param], 0.3)
            want = torch.nn.utils.clip_grad_norm_([dense], 0.3)
            torch.testing.assert_close(got.full_tensor(), want)
            opt.step()
            dense_opt.step()
        # The clip coefficient comes from a norm summed in another order: equal to float tolerance.
        torch.testing.assert_close(param.full_tensor(), dense.detach())


@pytest.mark.parametrize("ragged_mesh_dim", [0, 1])
def test_ragged_with_replicate_on_a_2d_mesh(dist_run, ragged_mesh_dim):
    dist_run(_everything_on_a_2d_mesh, 4, ragged_mesh_dim)


def _save_2d(path):
    mesh = init_device_mesh("cpu", (2, 2))
    dcp.save(
        {
            f"t{i}": distribute_tensor(_full(s), mesh, [Replicate(), RaggedShard(d, u)])
            for i, (s, d, u) in enumerate(CASES)
        },
        checkpoint_id=path,
    )


def _load_1d(path):
    mesh = init_device_mesh("cpu", (3,))
    state = {
        f"t{i}": distribute_tensor(torch.zeros(s), mesh, [RaggedShard(d, (1, 0, 1) if s[0] % 2 == 0 else (1, 1, 1))])
        for i, (s, d, u) in enumerate(CASES)
    }
    dcp.load(state, checkpoint_id=path)
    for i, (s, _, _) in enumerate(CASES):
        assert torch.equal(state[f"t{i}"].full_tensor(), _full(s)), i


def test_checkpoint_from_2d_mesh_loads_on_1d_mesh(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    dist_run(_save_2d, 4, path)
    dist_run(_load_1d, 3, path)

"""RaggedShard on real process groups: stock DTensor APIs against a dense single-process reference.

Every body runs on W gloo ranks (W = 1..4) and loops over tensors of rank 1 to 3 with uneven
units (from W=2, one rank holds nothing), in fp32 and bf16. The reference is the full tensor,
built identically on every rank from the same seed.
"""

import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.support.comm_counts import comm_counts
from vescale_plugins import RaggedShard

WORLD_SIZES = [1, 2, 3, 4]
DTYPES = [torch.float32, torch.bfloat16]

# Units per world size: uneven, and from W=2 a rank with zero units.
UNITS = {1: (1,), 2: (0, 3), 3: (2, 0, 1), 4: (1, 3, 0, 2)}
OTHER_UNITS = {1: (1,), 2: (2, 1), 3: (1, 1, 1), 4: (0, 1, 1, 1)}


def _cases():
    """(mesh, shape, placement, other): row-, element-, block-wise and partial-prefix shards of
    rank 1-3 on a 1-D mesh of every rank, each as ``UNITS`` and as ``OTHER_UNITS`` cut it."""
    world = dist.get_world_size()
    mesh, units = _mesh(), UNITS[world]
    total = sum(units)
    rows = 4 * total  # every case below has a row count divisible by the unit total
    for shape, dims in [
        ((rows,), (0,)),
        ((rows, 5), (0,)),
        ((2, 3 * total), (0, 1)),
        ((rows, 2, 3), (0,)),
        ((2, total, 3), (0, 1)),
        ((rows, 3), (0,)),
        ((rows // 2 * 2, 7), (0,)),
    ]:
        yield mesh, shape, RaggedShard(dims, units), RaggedShard(dims, OTHER_UNITS[world])


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _full(shape, dtype, salt=0):
    g = torch.Generator().manual_seed(hash((shape, salt)) % 2**31)
    return torch.randn(shape, generator=g).to(dtype)


# ----------------------------------------------------------------------------------
# construction and gathering
# ----------------------------------------------------------------------------------


def _construct_and_gather():
    rank = dist.get_rank()
    for mesh, shape, placement, _ in _cases():
        for dtype in DTYPES:
            full = _full(shape, dtype)
            d = distribute_tensor(full, mesh, [placement])
            assert d.placements == (placement,)
            assert d.shape == full.shape
            expected = placement.split_full(full, rank)
            assert d.to_local().shape == expected.shape
            assert torch.equal(d.to_local(), expected)
            assert torch.equal(d.full_tensor(), full)
            rebuilt = DTensor.from_local(expected.clone(), mesh, [placement], shape=full.shape, stride=full.stride())
            assert torch.equal(rebuilt.full_tensor(), full)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_distribute_from_local_to_local_full_tensor(dist_run, world):
    dist_run(_construct_and_gather, world)


# ----------------------------------------------------------------------------------
# redistribution: the right collective each way, and gradients through it
# ----------------------------------------------------------------------------------


def _redistribute_each_way():
    world, rank = dist.get_world_size(), dist.get_rank()
    for mesh, shape, src, dst in _cases():
        for dtype in DTYPES:
            full = _full(shape, dtype)
            d = distribute_tensor(full, mesh, [src])

            replicated, counts = comm_counts(lambda: d.redistribute(mesh, [Replicate()]))
            assert torch.equal(replicated.to_local(), full)
            if world > 1:
                assert set(counts) <= {"all_gather", "broadcast"}, counts
                assert sum(counts.values()) == 1, counts

            back, counts = comm_counts(lambda: replicated.redistribute(mesh, [src]))
            assert back.placements == (src,)
            assert torch.equal(back.to_local(), src.split_full(full, rank))
            assert counts == {}, counts

            moved, counts = comm_counts(lambda: d.redistribute(mesh, [dst]))
            assert torch.equal(moved.to_local(), dst.split_full(full, rank))
            if world > 1:
                assert counts == {"all_to_all": 1}, counts

            for tensor_dim in range(len(shape)):
                sharded = d.redistribute(mesh, [Shard(tensor_dim)])
                assert torch.equal(sharded.full_tensor(), full)
                assert torch.equal(sharded.to_local(), distribute_tensor(full, mesh, [Shard(tensor_dim)]).to_local())
                assert torch.equal(sharded.redistribute(mesh, [src]).to_local(), src.split_full(full, rank))

            contribution = full * (rank + 1)
            partial = DTensor.from_local(contribution, mesh, [Partial()], shape=full.shape, stride=full.stride())
            reduced, counts = comm_counts(lambda: partial.redistribute(mesh, [src]))
            total = full.float() * (world * (world + 1) / 2)
            torch.testing.assert_close(
                reduced.to_local().float(), src.split_full(total.to(dtype), rank).float(), rtol=1e-2, atol=1e-2
            )
            if world > 1:
                assert counts == {"reduce_scatter": 1}, counts

            # Ragged -> Partial is internal to DTensor: it is the backward of Partial -> Ragged.
            if dtype == torch.float32:
                contribution = contribution.clone().requires_grad_()
                partial = DTensor.from_local(contribution, mesh, [Partial()], shape=full.shape, stride=full.stride())
                weight = _full(shape, dtype, salt=2)
                (partial.redistribute(mesh, [src]) * distribute_tensor(weight, mesh, [src])).sum().backward()
                assert torch.equal(contribution.grad, weight)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_redistribute_uses_the_right_collective(dist_run, world):
    dist_run(_redistribute_each_way, world)


def _gradients_through_redistribute():
    for mesh, shape, placement, other in _cases():
        full, weight = _full(shape, torch.float32), _full(shape, torch.float32, salt=1)

        x = distribute_tensor(full, mesh, [placement]).requires_grad_()
        (x.redistribute(mesh, [Replicate()]).to_local() * weight).sum().backward()
        assert x.grad.placements == (placement,)
        assert torch.equal(x.grad.full_tensor(), weight)

        r = distribute_tensor(full, mesh, [Replicate()]).requires_grad_()
        ragged = r.redistribute(mesh, [placement])
        (ragged * distribute_tensor(weight, mesh, [placement])).sum().backward()
        assert torch.equal(r.grad.full_tensor(), weight)

        y = distribute_tensor(full, mesh, [placement]).requires_grad_()
        (y.redistribute(mesh, [other]) * distribute_tensor(weight, mesh, [other])).sum().backward()
        assert y.grad.placements == (placement,)
        assert torch.equal(y.grad.full_tensor(), weight)

        z = distribute_tensor(full, mesh, [placement]).requires_grad_()
        (z.full_tensor() * weight).sum().backward()
        assert torch.equal(z.grad.full_tensor(), weight)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_backward_of_redistribute(dist_run, world):
    dist_run(_gradients_through_redistribute, world)


# ----------------------------------------------------------------------------------
# ops: elementwise keeps the layout, reductions are global, the rest is correct or refused
# ----------------------------------------------------------------------------------


def _elementwise_and_reductions():
    for mesh, shape, p, other_placement in _cases():
        for dtype in DTYPES:
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            fa, fb = _full(shape, dtype), _full(shape, dtype, salt=1)
            a, b = distribute_tensor(fa, mesh, [p]), distribute_tensor(fb, mesh, [p])
            out_of_place = {
                "a + b": (a + b, fa + fb),
                "a * 2.5": (a * 2.5, fa * 2.5),
                "sqrt|a|": (torch.sqrt(a.abs()), torch.sqrt(fa.abs())),
                "to bf16": (a.to(torch.bfloat16), fa.to(torch.bfloat16)),
                "where": (torch.where(a > 0, a, b), torch.where(fa > 0, fa, fb)),
                "zeros_like": (torch.zeros_like(a), torch.zeros_like(fa)),
                "lerp": (torch.lerp(a, b, 0.3), torch.lerp(fa, fb, 0.3)),
            }
            for name, (got, want) in out_of_place.items():
                assert got.placements == (p,), (name, got.placements)
                assert torch.equal(got.full_tensor(), want), name

            other = distribute_tensor(fb, mesh, [other_placement])
            mixed = a + other
            assert mixed.placements == (p,)
            assert torch.equal(mixed.full_tensor(), fa + fb)
            replicated_b = distribute_tensor(fb, mesh, [Replicate()])
            assert torch.equal((a * replicated_b).full_tensor(), fa * fb)

            c = distribute_tensor(fa.clone(), mesh, [p])
            c.add_(b).mul_(0.5)
            assert c.placements == (p,)
            assert torch.equal(c.full_tensor(), (fa + fb).mul(0.5))
            c.copy_(other)
            assert c.placements == (p,)
            assert torch.equal(c.full_tensor(), fb)

            torch.testing.assert_close(a.sum().full_tensor(), fa.sum(), **tol)
            for ord in (2, 1, 3, math.inf):
                torch.testing.assert_close(
                    torch.linalg.vector_norm(a, ord).full_tensor(), torch.linalg.vector_norm(fa, ord), **tol
                )
            torch.testing.assert_close(a.norm().full_tensor(), fa.norm(), **tol)
            torch.testing.assert_close(a.mean().full_tensor(), fa.mean(), **tol)
            torch.testing.assert_close(a.sum(dim=0).full_tensor(), fa.sum(dim=0), **tol)
            if len(shape) == 2:
                eye = distribute_tensor(torch.eye(shape[1], dtype=dtype), mesh, [Replicate()])
                torch.testing.assert_close((a @ eye).full_tensor(), fa, **tol)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_elementwise_ops_keep_layout_and_reductions_are_global(dist_run, world):
    dist_run(_elementwise_and_reductions, world)


def _views_and_inplace_reshapes_are_refused():
    units = UNITS[dist.get_world_size()]
    full = _full((4 * sum(units), 3), torch.float32)
    a = distribute_tensor(full, _mesh(), [RaggedShard((0,), units)])
    with pytest.raises((NotImplementedError, RuntimeError), match="RaggedShard"):
        a.view(-1)
    with pytest.raises((NotImplementedError, RuntimeError), match="RaggedShard"):
        a.t()
    with pytest.raises((NotImplementedError, RuntimeError), match="RaggedShard"):
        a.t_()


@pytest.mark.parametrize("world", [2, 3])
def test_views_that_cannot_alias_a_ragged_shard_are_refused(dist_run, world):
    dist_run(_views_and_inplace_reshapes_are_refused, world)


def _views_to_the_same_shape_alias():
    for mesh, shape, placement, _ in _cases():
        full = _full(shape, torch.float32)
        param = torch.nn.Parameter(distribute_tensor(full, mesh, [placement]))
        for view in (param.view_as(param), param.view(shape), param.view(-1, *shape[1:])):
            assert isinstance(view, DTensor)
            assert view.placements == param.placements
            assert view.shape == param.shape
            assert view.to_local().data_ptr() == param.to_local().data_ptr()
            assert view.to_local().shape == param.to_local().shape
            # What pipelining's split backward reads: the parameter's gradient accumulator.
            assert view.grad_fn.next_functions[0][0].variable is param
        assert torch.equal(param.view_as(param).full_tensor(), full)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_views_to_the_same_shape_alias_a_ragged_shard(dist_run, world):
    dist_run(_views_to_the_same_shape_alias, world)


# ----------------------------------------------------------------------------------
# stock optimizers and gradient clipping
# ----------------------------------------------------------------------------------


def _param_sets():
    ragged, dense = [], []
    for i, (mesh, shape, p, _) in enumerate(_cases()):
        full = _full(shape, torch.float32, salt=10 + i)
        ragged.append(torch.nn.Parameter(distribute_tensor(full, mesh, [p])))
        dense.append(torch.nn.Parameter(full.clone()))
    return mesh, ragged, dense


def _set_grads(mesh, ragged, dense, step):
    for i, (r, d) in enumerate(zip(ragged, dense)):
        g = _full(tuple(d.shape), torch.float32, salt=100 * step + i)
        d.grad = g.clone()
        r.grad = distribute_tensor(g, mesh, list(r.placements))


def _optimizers_match_dense():
    factories = {
        "AdamW": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=fe),
        "SGD-momentum": lambda ps, fe: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=fe),
        "AdamW-fused": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        "SGD-fused": lambda ps, fe: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    }
    for name, factory in factories.items():
        for foreach in (True, False) if "fused" not in name else (None,):
            mesh, ragged, dense = _param_sets()
            opt_r, opt_d = factory(ragged, foreach), factory(dense, foreach)
            for step in range(3):
                _set_grads(mesh, ragged, dense, step)
                opt_r.step()
                opt_d.step()
            for r, d in zip(ragged, dense):
                assert isinstance(r.data, DTensor)
                assert isinstance(r.placements[0], RaggedShard)
                if "fused" in name:
                    # The fused CPU kernels vectorise by length: a shard's SIMD/tail split differs
                    # from the full tensor's, so results agree to rounding, not bit for bit.
                    torch.testing.assert_close(
                        r.full_tensor(), d.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}"
                    )
                else:
                    assert torch.equal(r.full_tensor(), d.detach()), (name, foreach)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_stock_optimizers_step_exactly_as_on_full_tensors(dist_run, world):
    dist_run(_optimizers_match_dense, world)


def _clip_grad_norm_matches_dense():
    for norm_type in (2.0, math.inf):
        for foreach in (True, False):
            mesh, ragged, dense = _param_sets()
            _set_grads(mesh, ragged, dense, 0)
            got = torch.nn.utils.clip_grad_norm_(ragged, max_norm=0.5, norm_type=norm_type, foreach=foreach)
            want = torch.nn.utils.clip_grad_norm_(dense, max_norm=0.5, norm_type=norm_type, foreach=foreach)
            got = got.full_tensor() if isinstance(got, DTensor) else got
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            for r, d in zip(ragged, dense):
                assert isinstance(r.grad.placements[0], RaggedShard)
                torch.testing.assert_close(r.grad.full_tensor(), d.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_clip_grad_norm_returns_the_global_norm_and_scales(dist_run, world):
    dist_run(_clip_grad_norm_matches_dense, world)


# ----------------------------------------------------------------------------------
# bad input: a clear ValueError on every rank, before any collective
# ----------------------------------------------------------------------------------


def _bad_input_raises_everywhere():
    world = dist.get_world_size()
    mesh = _mesh()
    full = torch.randn(6, 4)
    cases = {
        "units per mesh rank": (
            RaggedShard((0,), (1,) * (world + 1)),
            f"{world + 1} local_units for a mesh dim of {world} ranks",
        ),
        "rows do not divide": (
            RaggedShard((0,), (1,) * (world - 1) + (5 - world,)),
            "sum(local_units) must divide the 6 rows",
        ),
    }
    for name, (placement, message) in cases.items():
        for call in (
            lambda: distribute_tensor(full, mesh, [placement]),
            lambda: DTensor.from_local(torch.zeros(1, 4), mesh, [placement], shape=full.shape, stride=full.stride()),
        ):
            with pytest.raises(ValueError, match=re.escape(message)) as raised:
                call()
            assert "(6, 4)" in str(raised.value), (name, str(raised.value))
    with pytest.raises(ValueError, match="needs shape= and stride="):
        DTensor.from_local(torch.zeros(1, 4), mesh, [RaggedShard((0,), (1,) * world)])
    dist.barrier()  # every rank got here: nothing hung, nothing ran a collective early


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_is_a_value_error_on_every_rank(dist_run, world):
    dist_run(_bad_input_raises_everywhere, world)

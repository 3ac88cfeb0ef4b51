"""Bad input to fully_shard: a clear error on every rank, before any collective, module intact.

Mistakes that would otherwise fail late or inside torch (a unit sharded after its parent, a
process group for a mesh, a mesh without this rank, a block size that differs across ranks)
included.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.support.models import local_batch, make_decoder
from vescale_plugins import PlanMismatchError, fully_shard


def _untouched(model, before):
    """The failed call left the module as it was: same class, plain parameters, same values."""
    assert type(model) is before["class"]
    for name, p in model.named_parameters():
        assert not isinstance(p, DTensor), name
        assert torch.equal(p, before["params"][name]), name


def _snapshot(model):
    return {"class": type(model), "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _expect(error, match, fn):
    with pytest.raises(error, match=match):
        fn()


def _every_bad_input():
    world = dist.get_world_size()

    model = make_decoder()
    fully_shard(model.layers[0])
    _expect(
        ValueError, "fully_shard has already been applied to the following module", lambda: fully_shard(model.layers[0])
    )

    model = make_decoder()
    fully_shard(model.head)  # the head's weight is tied to the embedding, outside the head
    _expect(ValueError, r"shared between this unit and a unit inside it: 'embed.weight'", lambda: fully_shard(model))
    assert type(model).__name__ == "Decoder"
    assert getattr(model, "_vescale_fsdp_unit", None) is None
    assert not isinstance(model.embed.weight, DTensor)

    model = make_decoder()
    before = _snapshot(model)
    mesh_3d = init_device_mesh("cpu", (1, 1, world))
    _expect(
        ValueError, "fully_shard expects a 1D or 2D DeviceMesh .*dp_mesh_dims", lambda: fully_shard(model, mesh=mesh_3d)
    )
    _untouched(model, before)

    _expect(
        ValueError,
        r"block_size_fn\('up.weight'\) returned 0; it must return None or a positive int",
        lambda: fully_shard(model.layers[0], block_size_fn=lambda name, p: 0 if name == "up.weight" else None),
    )
    _untouched(model, before)

    _expect(ValueError, "ModuleList", lambda: fully_shard(model.layers))
    _untouched(model, before)
    _expect(
        ValueError,
        r"reshard_after_forward=5 must divide the shard group's size",
        lambda: fully_shard(model, reshard_after_forward=5),
    )
    _expect(
        NotImplementedError,
        r"pass OffloadPolicy\(\) \(none\) or CPUOffloadPolicy",
        lambda: fully_shard(model, offload_policy=type("DiskOffloadPolicy", (OffloadPolicy,), {})()),
    )
    _untouched(model, before)
    _expect(
        TypeError,
        "dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims",
        lambda: fully_shard(model, dp_mesh_dims=object()),
    )
    _expect(
        ValueError,
        r"Shard dim 2 is invalid for 2D tensor: .* \(shard_placement_fn returned Shard\(dim=2\) for 'layers.0.up.weight'\)",
        lambda: fully_shard(model, shard_placement_fn=lambda p: Shard(2) if p is model.layers[0].up.weight else None),
    )
    _untouched(model, before)
    tp_model = make_decoder()
    # a TP mesh that is not another dim of the data-parallel mesh's root (here: the same ranks)
    tp_model.layers[0].up.weight = torch.nn.Parameter(
        distribute_tensor(tp_model.layers[0].up.weight.detach(), init_device_mesh("cpu", (world,)), [Replicate()])
    )
    _expect(
        ValueError,
        r"'layers.0.up.weight' is a DTensor on mesh .* cannot be combined with the data-parallel mesh",
        lambda: fully_shard(tp_model),
    )
    assert type(tp_model).__name__ == "Decoder"
    fully_shard(model, offload_policy=OffloadPolicy(), shard_placement_fn=lambda p: Shard(0))  # FSDP2's defaults

    with torch.device("meta"):
        meta_model = make_decoder()
    fully_shard(meta_model)
    tokens, _ = local_batch(0)
    _expect(
        RuntimeError, r"still on meta device: \[.*\]\nFor example, call module.to_empty", lambda: meta_model(tokens)
    )

    dist.barrier()  # every rank got here: no rank was left waiting in a collective


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_fails_clearly_before_any_collective(dist_run, world):
    dist_run(_every_bad_input, world)


def _child_after_parent():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    with pytest.raises(
        ValueError, match=r"fully_shard\(Linear\): its parameter 'weight' is already sharded .* bottom-up"
    ):
        fully_shard(model[0])


def _process_group_as_mesh():
    with pytest.raises(TypeError, match=r"got a ProcessGroup; pass a DeviceMesh: .*DeviceMesh.from_group"):
        fully_shard(nn.Linear(4, 4), mesh=dist.group.WORLD)


def _mesh_without_this_rank():
    mesh = DeviceMesh("cpu", [0])  # every rank builds it (a collective), only rank 0 is in it
    model = nn.Linear(4, 4)
    if dist.get_rank() == 0:
        fully_shard(model, mesh=mesh)
        return
    with pytest.raises(ValueError, match=rf"global rank {dist.get_rank()}\) is not in the mesh \[0\]"):
        fully_shard(model, mesh=mesh)
    assert not isinstance(model.weight, DTensor)


def _rank_dependent_block_size_fn():
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    # 2 rows on rank 0, 4 on the others: each answer is valid on its own rank.
    with pytest.raises(
        PlanMismatchError,
        match=r"parameter '0.weight': rank 0 has shape \(8, 4\), torch.float32, blocks of 2 rows; rank 1 has .* blocks of 4 rows; block_size_fn",
    ):
        fully_shard(model, block_size_fn=lambda name, p: (2 if rank == 0 else 4) if name == "0.weight" else None)
    assert not isinstance(model[0].weight, DTensor)
    # An answer that is invalid on one rank only: every rank raises that rank's error.
    with pytest.raises(ValueError, match=r"block_size_fn\('0.weight'\) returned 0"):
        fully_shard(model, block_size_fn=lambda name, p: (0 if rank == 1 else None) if name == "0.weight" else None)
    # Nothing was left half-done: the same model still shards and runs.
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model(torch.ones(1, 4)).sum().backward()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "body", [_child_after_parent, _process_group_as_mesh, _mesh_without_this_rank, _rank_dependent_block_size_fn]
)
def test_setup_error_on_every_rank_before_any_collective(dist_run, body):
    dist_run(body, 2, timeout=60)

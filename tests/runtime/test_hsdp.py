"""Hybrid sharding (HSDP) on a 2-D (replicate, shard) mesh trains what FSDP2's HSDP and an
unsharded model train; checkpoints move between meshes."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from tests.support.comm_counts import comm_counts
from tests.support.models import clone, local_batch, loss_fn, make_decoder, reference_step
from tests.support.parity import (
    TOL,
    adamw,
    assert_matches,
    reference_ours_and_fsdp2s,
    shard_decoder,
    sharded_step,
    step_and_zero,
)
from vescale_plugins import RaggedShard

STEPS = 4


def _hsdp_mesh():
    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))


def _hsdp_parity():
    world = dist.get_world_size()
    mesh = _hsdp_mesh()
    reference, ours, theirs = reference_ours_and_fsdp2s(mesh=mesh)
    for p in ours.parameters():
        # Equal, not necessarily the same object: DTensor's sharding-propagation cache hands out
        # the first equal mesh a worker saw (FSDP2's parameters too).
        assert p.device_mesh == mesh
        assert p.placements[0] == Replicate()
        assert isinstance(p.placements[1], RaggedShard)
    opts = [adamw(m) for m in (reference, ours, theirs)]
    for step in range(STEPS):
        ref_loss = reference_step(reference, step, world)
        torch.testing.assert_close(sharded_step(ours, step), ref_loss, **TOL)
        sharded_step(theirs, step)
        assert_matches(ours, reference, "grad")
        assert_matches(ours, theirs, "grad")
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        step_and_zero(*opts)
        assert_matches(ours, reference, "param")
        assert_matches(ours, theirs, "param")


def test_hsdp_2x2_matches_fsdp2_and_unsharded(dist_run):
    dist_run(_hsdp_parity, 4)


def _hsdp_collectives():
    mesh = _hsdp_mesh()
    model = shard_decoder(make_decoder(), mesh=mesh)
    tokens, targets = local_batch(0)
    loss = loss_fn(model(tokens), targets)
    _, counts = comm_counts(loss.backward)
    units = len(model.layers) + 1
    # one reduce-scatter per unit buffer in the shard group, one all-reduce per unit across replicas
    assert counts.get("reduce_scatter") == units, counts
    assert counts.get("all_reduce") == units, counts


def test_hsdp_reduce_scatters_in_the_shard_group_then_all_reduces_across_replicas(dist_run):
    dist_run(_hsdp_collectives, 4)


def _requires_all_reduce_false():
    """Accumulating without the all-reduce, then all-reducing once: FSDP2's HSDP pattern."""
    world = dist.get_world_size()
    mesh = _hsdp_mesh()
    reference, ours, theirs = reference_ours_and_fsdp2s(mesh=mesh)
    for model in (ours, theirs):
        for micro in range(3):
            model.set_requires_all_reduce(micro == 2)
            tokens, targets = local_batch(micro)
            (loss_fn(model(tokens), targets) / 3).backward()
    for micro in range(3):
        reference_step(reference, micro, world)
    for p in reference.parameters():
        p.grad /= 3
    assert_matches(ours, reference, "grad")
    assert_matches(ours, theirs, "grad")


def test_set_requires_all_reduce_false_accumulates_then_all_reduces(dist_run):
    dist_run(_requires_all_reduce_false, 4)


def _checkpoint_across_meshes(path):
    world = dist.get_world_size()
    reference = make_decoder()
    hsdp = shard_decoder(clone(reference), mesh=_hsdp_mesh())
    opt, ref_opt = adamw(hsdp), adamw(reference)
    for step in range(2):
        reference_step(reference, step, world)
        sharded_step(hsdp, step)
        step_and_zero(opt, ref_opt)
    dcp.save({"model": get_model_state_dict(hsdp), "optim": get_optimizer_state_dict(hsdp, opt)}, checkpoint_id=path)
    # the uninterrupted run's next step
    reference_step(reference, 2, world)
    ref_opt.step()
    # the same checkpoint on a 1 x 4 HSDP mesh and on a flat 4-rank mesh continues it exactly
    for mesh in (
        init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")),
        init_device_mesh("cpu", (world,)),
    ):
        restored = shard_decoder(make_decoder(seed=3), mesh=mesh)
        restored_opt = adamw(restored)
        sharded_step(restored, 0)
        restored_opt.step()  # optimizer state to load into
        state = {"model": get_model_state_dict(restored), "optim": get_optimizer_state_dict(restored, restored_opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(restored, state["model"])
        set_optimizer_state_dict(restored, restored_opt, state["optim"])
        restored_opt.zero_grad()
        sharded_step(restored, 2)
        restored_opt.step()
        assert_matches(restored, reference, "param")


def test_hsdp_checkpoint_loads_on_other_meshes(dist_run, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hsdp_ckpt"))
    dist_run(_checkpoint_across_meshes, 4, path)

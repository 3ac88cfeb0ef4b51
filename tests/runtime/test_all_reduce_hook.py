"""``set_all_reduce_hook`` gives what FSDP2's gives: the hook runs in place on each unit's
reduce output (after HSDP's all-reduce) before it lands in the sharded gradients, and sees the
mean, or the sum under ``set_force_sum_reduction_for_comms(True)``."""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.support.models import reference_step
from tests.support.parity import adamw, assert_matches, reference_ours_and_fsdp2s, sharded_step, step_and_zero


def _add_one(reduce_output):
    # Affine, so it tells the mean from the sum: FSDP2 adds before its post-divide under
    # force-sum (fp32), after the division otherwise.
    reduce_output.add_(1.0)


def _hook_parity(mesh_kind, force_sum):
    """A step of ours and FSDP2 with the same hook on every unit: same gradients and
    parameters. ``mesh_kind``: "flat" (FSDP), "hsdp" (2 x W/2) or "pairs" (FSDP within
    pairs of ranks, the hook all-reducing across them: a hand-made HSDP)."""
    world = dist.get_world_size()
    hook = _add_one
    if mesh_kind == "flat":
        mesh = init_device_mesh("cpu", (world,))
    else:
        hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        mesh = hsdp if mesh_kind == "hsdp" else hsdp["shard"]
        if mesh_kind == "pairs":
            replicas = hsdp["replicate"].get_group()

            def hook(reduce_output):
                dist.all_reduce(reduce_output, group=replicas)
                reduce_output.div_(2)

    reference, ours, theirs = reference_ours_and_fsdp2s(mesh=mesh)
    calls = {id(ours): 0, id(theirs): 0}
    for model in (ours, theirs):

        def counted(reduce_output, model=model):
            calls[id(model)] += 1
            hook(reduce_output)

        for module in [*model.layers, model]:
            module.set_all_reduce_hook(counted)
            module.set_force_sum_reduction_for_comms(force_sum)
    opts = [adamw(m) for m in (reference, ours, theirs)]
    reference_step(reference, 0, world)
    sharded_step(ours, 0)
    sharded_step(theirs, 0)
    assert_matches(ours, theirs, "grad")
    if mesh_kind == "pairs":  # the mean over every rank's batch: what DDP gives
        assert_matches(ours, reference, "grad")
    step_and_zero(*opts)
    assert_matches(ours, theirs, "param")
    assert calls[id(ours)] >= calls[id(theirs)] > 0  # once per unit (ours: per gradient buffer)


def _hook_parities(configs):
    for mesh_kind, force_sum in configs:
        _hook_parity(mesh_kind, force_sum)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_hook_matches_fsdp2(dist_run, world):
    dist_run(_hook_parities, world, [("flat", False), ("flat", True)])


def _hsdp_hook_parities_and_refusal():
    _hook_parities([("hsdp", False), ("hsdp", True), ("pairs", False)])
    hsdp = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    _, ours, theirs = reference_ours_and_fsdp2s(mesh=hsdp)
    messages = []
    for model in (ours, theirs):
        with pytest.raises(ValueError, match="stream cannot be set when using native HSDP") as error:
            model.set_all_reduce_hook(_add_one, stream=object())
        messages.append(str(error.value))
    return messages


def test_all_reduce_hook_under_hsdp_and_as_hand_made_hsdp_matches_fsdp2(dist_run):
    """Native HSDP (the hook after the all-reduce across replicas), and FSDP within pairs of
    ranks whose hook all-reduces across them; a hook stream under native HSDP is refused
    with FSDP2's error."""
    ours, theirs = dist_run(_hsdp_hook_parities_and_refusal, 4)[0]
    assert ours == theirs

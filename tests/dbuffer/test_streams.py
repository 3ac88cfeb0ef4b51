"""The CUDA path of the collectives (side streams, event waits), run on CPU with gloo.

CI has no GPU, so a stand-in for ``torch.cuda``'s stream API records what the protocol does
while gloo runs each collective synchronously (as NCCL's enqueue-and-return would look from
the host). The same DBuffer and FSDPUnit code runs as on CUDA; what cannot be checked here is
the GPU's own scheduling.
"""

import torch
import torch.distributed as dist

import vescale_plugins.dbuffer.storage as storage_module
from tests.support.parity import TOL, assert_matches, reference_and_ours, sharded_step, train_like_reference
from tests.support.streams import FakeStreamAPI, stand_in_streams
from vescale_plugins.dbuffer.buffer import DBuffer
from vescale_plugins.dbuffer.planning import plan_buffers
from vescale_plugins.dbuffer.reduction import GradientReduction
from vescale_plugins.dbuffer.streams import CommStreams


def _logging_allocations(api):
    """Log which stream is current when a DBuffer grows a buffer's storage."""
    original = storage_module.ResizableStorage.allocate

    def allocate(toggle):
        if not toggle.allocated:
            api.log.append(("allocate", api.active.name))
        return original(toggle)

    return original, allocate


def _protocol_of_one_gather_and_reduce():
    world, rank = dist.get_world_size(), dist.get_rank()
    api = FakeStreamAPI()
    shapes = [torch.Size([5, 3]), torch.Size([7])]
    (plan,) = plan_buffers(shapes, [1, 1], torch.float32, torch.float32, world)
    dbuffer = DBuffer(shapes, [1, 1], torch.float32, torch.device("cpu"), dist.group.WORLD, plan.layout)
    dbuffer.streams = CommStreams(torch.device("cpu"), api)
    full = [torch.arange(15.0).view(5, 3), torch.arange(7.0) * 10]
    for index, tensor in enumerate(full):
        slot = dbuffer.slots[index]
        start = rank * dbuffer.shard_size + slot.local_offset - slot.global_offset
        dbuffer.sharded_view(index).reshape(-1).copy_(tensor.reshape(-1)[start : start + slot.local_length])
    original, allocate = _logging_allocations(api)
    storage_module.ResizableStorage.allocate = allocate
    try:
        gather = dbuffer.all_gather(async_op=True)
        # Issued on the all-gather stream after it waited for compute; memory is that stream's.
        assert api.log == [
            ("wait_stream", "all_gather", "compute"),
            ("allocate", "all_gather"),
            ("record", "all_gather", 1),
        ], api.log
        gather.wait()
        assert api.log[-1] == ("wait_event", "compute", 1)
        for index, tensor in enumerate(full):
            torch.testing.assert_close(dbuffer.unsharded_view(index), tensor)

        api.log.clear()
        dbuffer.fill_unsharded_grad({index: tensor * (rank + 1) for index, tensor in enumerate(full)})
        reduce = dbuffer.reduce_scatter(GradientReduction(reduce_scatter_average=True), accumulate=False, async_op=True)
        assert api.log == [
            ("allocate", "compute"),
            ("wait_stream", "reduce_scatter", "compute"),
            ("record", "reduce_scatter", 2),
        ], api.log
        assert dbuffer.has_unsharded_grad  # the input stays until compute has waited for it
        reduce.wait()
        assert api.log[-1] == ("wait_event", "compute", 2)
        assert not dbuffer.has_unsharded_grad
        mean = sum(range(1, world + 1)) / world
        for index, tensor in enumerate(full):
            slot = dbuffer.slots[index]
            start = rank * dbuffer.shard_size + slot.local_offset - slot.global_offset
            want = (tensor.reshape(-1) * mean)[start : start + slot.local_length]
            torch.testing.assert_close(dbuffer.sharded_grad_view(index).reshape(-1), want)
    finally:
        storage_module.ResizableStorage.allocate = original


def test_stream_protocol_of_one_gather_and_one_reduce(dist_run):
    dist_run(_protocol_of_one_gather_and_reduce, 3)


def _trains_like_the_unsharded_model_on_side_streams():
    with stand_in_streams() as api:
        reference, model = reference_and_ours()

        def check_step(loss, reference_loss):
            torch.testing.assert_close(loss, reference_loss, **TOL)
            assert_matches(model, reference, "grad")

        train_like_reference(model, reference, 3, check_step)
    # Every collective's event was waited on by the compute stream, exactly once.
    recorded = [entry[2] for entry in api.log if entry[0] == "record"]
    waited = [entry[2] for entry in api.log if entry[0] == "wait_event"]
    assert recorded
    assert sorted(waited) == recorded
    assert all(entry[1] == "compute" for entry in api.log if entry[0] == "wait_event")


def test_trains_like_the_unsharded_model_on_side_streams(dist_run):
    dist_run(_trains_like_the_unsharded_model_on_side_streams, 2)


class _PostOptimEvent:
    def __init__(self):
        self.synchronized = False

    def synchronize(self):
        self.synchronized = True


def _post_optim_event_is_waited_on_the_all_gather_stream():
    with stand_in_streams() as api:
        _, model = reference_and_ours()
        sharded_step(model, 0)
        event = _PostOptimEvent()
        model.set_post_optim_event(event)
        api.log.clear()
        sharded_step(model, 1)
    gather_waits = [entry for entry in api.log if entry[1] == "all_gather" and entry[0].startswith("wait")]
    return event.synchronized, gather_waits[0] == ("wait_event", "all_gather", event), gather_waits[1:]


def test_post_optim_event_is_a_stream_wait_as_fsdp2(dist_run):
    """The next forward's first all-gather waits for the event on its stream (FSDP2's
    root pre-forward), the host never blocks on it, later gathers wait for compute."""
    synchronized, first_waits_for_event, later = dist_run(_post_optim_event_is_waited_on_the_all_gather_stream, 2)[0]
    assert not synchronized
    assert first_waits_for_event
    assert later
    assert all(entry == ("wait_stream", "all_gather", "compute") for entry in later)


def _reduce_scatter_schedule(max_input_buffers):
    """One backward's collectives as ("issue", n) / ("wait", n) per reduce-scatter event n,
    and "gather" per all-gather issued, in order."""
    with stand_in_streams() as api:
        _, model = reference_and_ours()
        model.set_reduce_scatter_max_input_buffers(max_input_buffers)
        sharded_step(model, 0)
    reduce_events = {entry[2] for entry in api.log if entry[:2] == ("record", "reduce_scatter")}
    first = next(i for i, entry in enumerate(api.log) if entry[:2] == ("record", "reduce_scatter"))
    schedule = []
    for entry in api.log[first:]:
        if entry[:2] == ("record", "reduce_scatter"):
            schedule.append(("issue", entry[2]))
        elif entry[:2] == ("wait_event", "compute") and entry[2] in reduce_events:
            schedule.append(("wait", entry[2]))
        elif entry[:2] == ("record", "all_gather"):
            schedule.append("gather")
    return schedule


def _in_flight(schedule):
    """The most reduce-scatters issued and not yet waited for, over the schedule."""
    pending, most = set(), 0
    for step in schedule:
        if step != "gather":
            kind, event = step
            pending.add(event) if kind == "issue" else pending.discard(event)
            most = max(most, len(pending))
    return most, pending


def test_reduce_scatter_is_waited_at_the_next_post_backward_as_fsdp2(dist_run):
    """FSDP2's place: a unit's reduce-scatter overlaps the next unit's whole backward (its
    prefetch included) and is waited for at that unit's post-backward, before it issues its own;
    the last ones at the end of backward."""
    schedule = dist_run(_reduce_scatter_schedule, 2, 1)[0]
    first = schedule[0]
    assert first[0] == "issue", schedule
    assert schedule.index("gather") < schedule.index(("wait", first[1])), schedule
    assert _in_flight(schedule) == (1, set()), schedule


def test_reduce_scatter_max_input_buffers_bounds_the_units_in_flight_as_fsdp2(dist_run):
    schedule = dist_run(_reduce_scatter_schedule, 2, 2)[0]
    assert _in_flight(schedule) == (2, set()), schedule
    # The oldest is waited for only when a third would be issued.
    (_, first), (_, second) = [s for s in schedule if s != "gather" and s[0] == "issue"][:2]
    assert schedule.index(("issue", second)) < schedule.index(("wait", first)), schedule


def _after_reduce_scatter_log(hsdp, hook_stream_name):
    """One backward's stream log, and the stream current at each all-reduce hook call."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,))
    )
    hooked_on = []
    with stand_in_streams() as api:
        _, model = reference_and_ours(mesh=mesh)
        if hook_stream_name is not None:
            stream = None if hook_stream_name == "all_reduce" else api._Stream(api, hook_stream_name)
            for module in [*model.layers, model]:
                module.set_all_reduce_hook(lambda out: hooked_on.append(api.active.name), stream=stream)
        sharded_step(model, 0)
    return api.log, hooked_on, len(model.layers) + 1


def _after_reduce_scatter_schedule(log, stream):
    """Per reduce-scatter event: the event ``stream`` records after waiting on it, and the log
    positions of the compute stream's waits on each."""
    followed = {}
    for i, entry in enumerate(log):
        if entry[:2] == ("wait_event", stream) and i + 1 < len(log) and log[i + 1][:2] == ("record", stream):
            followed[entry[2]] = log[i + 1][2]
    compute_waits = {entry[2]: i for i, entry in enumerate(log) if entry[:2] == ("wait_event", "compute")}
    return followed, compute_waits


def test_hsdp_all_reduce_on_its_stream_waited_at_the_end_of_backward_as_fsdp2(dist_run):
    """FSDP2's foreach_reduce: the all-reduce stream waits for the reduce-scatter (not for
    compute) and all-reduces at once; the compute stream waits for it only at the end of
    backward (finalize_backward), while each reduce-scatter is still waited for at the next
    unit's post-backward."""
    log, _, _ = dist_run(_after_reduce_scatter_log, 4, True, None)[0]
    reduce_events = [entry[2] for entry in log if entry[:2] == ("record", "reduce_scatter")]
    followed, compute_waits = _after_reduce_scatter_schedule(log, "all_reduce")
    assert reduce_events, log
    assert sorted(followed) == reduce_events, log
    last_issue = max(i for i, entry in enumerate(log) if entry[:2] == ("record", "reduce_scatter"))
    # each reduce-scatter waited for before the last is issued; each all-reduce only after it
    assert all(compute_waits[event] < last_issue for event in reduce_events[:-1]), log
    assert all(compute_waits[done] > last_issue for done in followed.values()), log
    assert not any(entry[:2] == ("wait_stream", "all_reduce") for entry in log), log


def test_all_reduce_hook_runs_on_the_all_reduce_stream_as_fsdp2(dist_run):
    """The hook runs once per unit on the all-reduce stream after the reduce-scatter (and
    after HSDP's all-reduce, on the same stream), or on the stream given without HSDP; the
    compute stream waits for it at the end of backward."""
    for hsdp, stream in ((False, "all_reduce"), (True, "all_reduce"), (False, "user")):
        log, hooked_on, units = dist_run(_after_reduce_scatter_log, 4 if hsdp else 2, hsdp, stream)[0]
        assert hooked_on == [stream] * units, (hsdp, stream, hooked_on)
        followed, compute_waits = _after_reduce_scatter_schedule(log, stream)
        assert len(followed) == units, log
        assert all(done in compute_waits for done in followed.values()), log

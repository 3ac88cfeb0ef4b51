"""On CUDA the run record times collectives and steps with timing events on the streams the
work runs on, read when the record is reported: run here through a stand-in ``torch.cuda``."""

import vescale_plugins.observe.record as record_module
from tests.support.parity import adamw, reference_and_ours, sharded_step, step_and_zero
from tests.support.streams import stand_in_streams
from vescale_plugins.observe.record import record_run


def _record_on_stand_in_streams():
    with stand_in_streams() as api:
        original = record_module._device_timing_module
        record_module._device_timing_module = lambda device_type: api
        try:
            _, model = reference_and_ours()
            opt = adamw(model)
            with record_run(model, opt) as record:
                sharded_step(model, 0)
                step_and_zero(opt)
                record.mark_step()
            syncs_while_training = api.syncs
            report = record.to_dict()
        finally:
            record_module._device_timing_module = original
    return api.log, syncs_while_training, report


def test_collectives_and_steps_are_timed_by_events_on_their_streams(dist_run):
    log, syncs_while_training, report = dist_run(_record_on_stand_in_streams, 2)[0]
    assert syncs_while_training == 0  # nothing read back until the report
    times = [entry for entry in log if entry[0] == "time"]
    events = report["communication"]["events"]
    # Per collective: issued and enqueued on its own stream, the wait's mark on compute.
    on_side = [name for _, name, _ in times if name != "compute"]
    assert on_side.count("all_gather") == 2 * sum(e["kind"] == "all_gather" for e in events)
    assert on_side.count("reduce_scatter") == 2 * sum(e["kind"] == "reduce_scatter" for e in events)
    assert set(on_side) == {"all_gather", "reduce_scatter"}
    # The stand-in clock ticks 1 ms per mark: nothing is recorded between issue and enqueue.
    assert events
    assert all(abs(e["end_s"] - e["start_s"] - 1e-3) < 1e-9 for e in events)
    assert all(e["exposed_s"] >= 0 for e in events)
    steps = report["steps"]
    assert steps["clock"] == "cuda_events"
    assert len(steps["seconds"]) == 1
    assert steps["seconds"][0] > 0

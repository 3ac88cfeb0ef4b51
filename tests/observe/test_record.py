"""The run record: sharding, precision, memory and every collective of a recorded run."""

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.support.models import LAYERS, local_batch, loss_fn, make_decoder
from tests.support.parity import adamw, shard_decoder
from vescale_plugins.dbuffer import observer
from vescale_plugins.observe import record as run_record
from vescale_plugins.observe.record import record_run


def _train(model, opt, steps, record=None):
    for step in range(steps):
        tokens, targets = local_batch(step)
        loss_fn(model(tokens), targets).backward()
        opt.step()
        opt.zero_grad()
        if record is not None:
            record.mark_step()


def _recorded_run():
    world = dist.get_world_size()
    model = shard_decoder(
        make_decoder(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    opt = adamw(model)
    _train(model, opt, 1)
    with record_run(model, opt) as record:
        _train(model, opt, 2, record)
    d = record.to_dict()
    units = LAYERS + 1

    s = d["sharding"]
    assert s["group_size"] == world
    assert s["group_ranks"] == list(range(world))
    assert s["backend"] == "gloo"
    assert [u["modules"] for u in s["units"]] == [[""]] + [[f"layers.{i}"] for i in range(LAYERS)]
    assert sum(u["parameters"] for u in s["units"]) == sum(p.numel() for p in model.parameters())
    assert all(u["largest_unsharded_bytes"] > 0 and 0 <= u["padding_ratio"] < 1 for u in s["units"])

    p = d["precision"]
    assert p["sharded_parameters"] == ["float32"]
    assert p["all_gather"] == ["bfloat16"]
    assert p["reduce_scatter"] == ["float32"]
    assert p["optimizer_state"] == ["float32"]

    c = d["communication"]["summary"]
    # Each block is gathered for forward and again for backward; the root stays gathered.
    assert c["all_gather"]["count_per_step"] == 2 * LAYERS + 1, c
    assert c["reduce_scatter"]["count_per_step"] == units, c
    assert c["reduce_scatter"]["bytes_per_step"] > 0
    assert c["all_gather"]["bytes_per_step"] > 0
    events = d["communication"]["events"]
    assert {e["unit"] for e in events} == {"<root>", *(f"layers.{i}" for i in range(LAYERS))}
    assert all(e["end_s"] >= e["start_s"] and 0 <= e["overlap_ratio"] <= 1 for e in events)
    # The first all-gather of a step is synchronous: nothing hides it.
    first_gathers = [next(e for e in events if e["step"] == s and e["kind"] == "all_gather") for s in (0, 1)]
    assert all(e["overlap_ratio"] == 0 for e in first_gathers), first_gathers
    assert {e["step"] for e in events} == {0, 1}

    m = d["memory"]
    assert m["peak_bytes_by_kind"]["unsharded_params"] > 0
    assert m["peak_bytes_by_kind"]["unsharded_grads"] > 0
    assert m["sharded_state_bytes"]["optimizer_state"] > 0

    # One unit's gradient buffer alive at a time: a unit's buffer is made after it reshards
    # and after the previous unit's reduce-scatter has freed that unit's buffer.
    def grad_buffer_bytes(module):
        return sum(b._unsharded_grad.nbytes for b in module._vescale_fsdp_unit.dbuffers)

    largest = max(grad_buffer_bytes(unit) for unit in (model, *model.layers))
    assert m["peak_bytes_by_kind"]["unsharded_grads"] == largest, (m["peak_bytes_by_kind"], largest)
    # Gradients are reduced in fp32 from a buffer made in fp32 (the copy into it is the cast):
    # the only communication buffers are the bf16 all-gather inputs and reduce-scatter outputs.
    assert m["peak_bytes_by_kind"]["comm_buffers"] < largest, m["peak_bytes_by_kind"]
    # The peak of all live tensor bytes, split by what they were: every kind accounted for.
    peak = m["peak"]
    assert set(peak["split"]) == set(run_record.PEAK_KINDS)
    assert sum(peak["split"].values()) == peak["total_bytes"]
    state = m["sharded_state_bytes"]
    assert peak["split"]["sharded_state"] == state["parameters"] + state["optimizer_state"]
    # The root stays gathered through forward and backward, where the peak is.
    for kind in ("unsharded_params", "activations_and_temporaries"):
        assert peak["split"][kind] > 0, (kind, peak)
    assert peak["split"]["unsharded_params"] <= m["peak_bytes_by_kind"]["unsharded_params"]
    z = d["zero_stages"]
    assert math.isclose(z["model_bytes_per_parameter"]["ZeRO-3 / FSDP"], 16 / world)
    assert "run record" in record.summary()

    # Closed: nothing is collected any more.
    assert observer.current() is None
    before = len(record.events)
    _train(model, opt, 1)
    assert len(record.events) == before
    return record.summary() if dist.get_rank() == 0 else ""


def test_record_of_a_sharded_run(dist_run):
    summary = dist_run(_recorded_run, 3)[0]
    assert "all_gather" in summary
    assert "reduce_scatter" in summary


def test_record_leaves_a_running_profiler_alone():
    """Inside a user's own torch.profiler session the record does not start another (kineto
    cannot nest) and says why the peak split is missing."""
    model = torch.nn.Linear(3, 2)
    with torch.profiler.profile():
        with record_run(model) as record:
            model(torch.randn(4, 3)).sum().backward()
    assert record.to_dict()["memory"]["peak"] == {"unavailable": "another torch.profiler session was running"}
    assert "not measured (another torch.profiler session was running)" in record.summary()

"""``cuda_event_timing``: the run record times collectives and steps with CUDA events, and
costs no host sync while it records.

The suite's decoder, sharded on every rank, trains a few steps inside ``record_run`` under
``torch.cuda.set_sync_debug_mode("error")`` (the report is read outside it). Each step is also
timed on the host with ``torch.cuda.synchronize()`` around it (outside the debug mode). Must
show: the steps' clock is "cuda_events"; every collective's ``end_s >= start_s`` and
``exposed_s`` between 0 and its duration; each recorded step within 20 % (plus 1 ms) of the
synchronised wall-clock step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.tools import parity_model
from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run"]

STEPS = 4
STEP_TOLERANCE, STEP_SLACK_S = 0.2, 1e-3


def _timed_rank() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from vescale_plugins import fully_shard
    from vescale_plugins.observe.record import record_run

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = parity_model.make_decoder().to(device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    # On the device before the timed steps: a copy from pageable host memory synchronizes,
    # which the steps' sync check (set_sync_debug_mode("error")) refuses.
    batches = [tuple(t.to(device) for t in parity_model.local_batch(i)) for i in range(STEPS + 1)]

    def step(i: int) -> None:
        tokens, targets = batches[i]
        parity_model.loss_fn(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)  # the first step builds the buffers and the optimizer state
    wall = []
    with record_run(model, optimizer) as record:
        torch.cuda.synchronize()
        record.mark_step()
        for i in range(1, STEPS + 1):
            started = time.perf_counter()
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(i)
                record.mark_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - started)
    report = record.to_dict()
    events = report["communication"]["events"]
    bad_events = [
        e
        for e in events
        if not (e["end_s"] >= e["start_s"] and 0 <= e["exposed_s"] <= e["end_s"] - e["start_s"] + 1e-6)
    ]
    recorded = report["steps"]["seconds"]
    off = [(r, w) for r, w in zip(recorded, wall, strict=True) if abs(r - w) > STEP_TOLERANCE * w + STEP_SLACK_S]
    return {
        "clock": report["steps"]["clock"],
        "collectives": len(events),
        "collectives_out_of_order": bad_events[:5],
        "recorded_step_s": recorded,
        "wall_step_s": wall,
        "steps_off": off,
    }


def run(ctx: PartContext) -> dict[str, Any]:
    ranks = launch(ctx, _timed_rank)
    figures: dict[str, Any] = {"ranks": ranks, **ctx.figures()}
    failures = [
        f"rank {i}: {r['clock']} clock, {len(r['collectives_out_of_order'])} collectives out of order, "
        f"{len(r['steps_off'])} steps off the wall clock"
        for i, r in enumerate(ranks)
        if r["clock"] != "cuda_events" or r["collectives_out_of_order"] or r["steps_off"]
    ]
    assert not failures, (failures, figures)
    figures["summary"] = (
        f"run record on CUDA events: {ranks[0]['collectives']} collectives timed, no host sync while recording, "
        f"steps within {STEP_TOLERANCE:.0%} of the synchronised wall clock"
    )
    return figures

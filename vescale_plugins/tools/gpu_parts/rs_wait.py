"""``rs_wait``: where the compute stream waits for a unit's reduce-scatter, measured.

A fixed GPU sleep is put on the reduce-scatter stream before every reduce-scatter. A unit's
reduce-scatter is waited for at the next unit's post-backward (FSDP2's place), so the sleep
hides behind that unit's backward: each of the ``N - 1`` block units may add at most
``max(0, sleep - unit backward)``, and the last two (the one before the root's small
backward, and the root's, waited at the end of backward) up to one sleep each. Waiting at
the next unit's first gradient instead would expose nearly the whole sleep at every unit.

It runs in one process of a fake two-rank group (``FakeProcessGroup``: the collectives do
nothing, the streams, events, waits and sleeps are real), so it measures the wait's place,
not NCCL, and needs no second rank.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vescale_plugins.tools.gpu_parts.context import PartContext, timed_ms
from vescale_plugins.tools.gpu_parts.parity import provoked_streams

__all__ = ["run"]

UNITS, HIDDEN, TOKENS, ITERS = 8, 4096, 4096, 6


def _model(device: torch.device) -> nn.Module:
    blocks = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN)) for _ in range(UNITS)]
    return nn.Sequential(*blocks, nn.Linear(HIDDEN, 8)).to(device)


def _cycles_per_ms() -> float:
    cycles = 20_000_000
    return cycles / timed_ms(lambda: torch.cuda._sleep(cycles), iters=3)


def run(ctx: PartContext) -> dict[str, Any]:
    if ctx.kind != "cuda":
        return {"status": "skipped", "reason": "CUDA only: off CUDA collectives are waited on the host, no streams"}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vescale_plugins import fully_shard

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        device, mesh = torch.device("cuda", 0), init_device_mesh("cuda", (2,))
        model = _model(device)
        for block in list(model.children())[:UNITS]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(TOKENS, HIDDEN, device=device)

        def forward() -> torch.Tensor:
            return model(x).square().mean()

        def step() -> None:
            forward().backward()
            model.zero_grad(set_to_none=True)

        started = time.perf_counter()
        with torch.no_grad():  # the forward's share of a step (no graph kept, no backward owed)
            forward_ms = timed_ms(forward, ITERS)
        step_ms = timed_ms(step, ITERS)
        unit_backward_ms = (step_ms - forward_ms) / UNITS
        cycles_per_ms = _cycles_per_ms()
        points = []
        for ratio in (0.5, 2.0):
            sleep_ms = ratio * unit_backward_ms
            with provoked_streams(int(sleep_ms * cycles_per_ms), which="reduce_scatter") as counts:
                slept_ms = timed_ms(step, ITERS)
            growth = slept_ms - step_ms
            bound = (UNITS - 1) * max(0.0, sleep_ms - unit_backward_ms) + 2 * sleep_ms
            margin = 0.05 * step_ms + 0.2  # timing noise of a few-millisecond step
            points.append(
                {
                    "sleep_ms": sleep_ms,
                    "step_ms": slept_ms,
                    "growth_ms": growth,
                    "bound_ms": bound,
                    "margin_ms": margin,
                    "within_bound": growth <= bound + margin,
                    "reduce_scatter_sleeps": counts["side_stream_sleeps"],
                    "growth_if_waited_at_the_first_gradient_ms": UNITS * sleep_ms,
                }
            )
        out = {
            "summary": "; ".join(
                f"sleep {p['sleep_ms']:.2f} ms: +{p['growth_ms']:.2f} ms (bound {p['bound_ms']:.2f})" for p in points
            )
            + f"; unit backward {unit_backward_ms:.2f} ms",
            "process_group": "fake, W=2 (collectives do nothing; streams and waits are real)",
            "units": UNITS,
            "forward_ms": forward_ms,
            "step_ms": step_ms,
            "unit_backward_ms": unit_backward_ms,
            "cycles_per_ms": cycles_per_ms,
            "points": points,
            "seconds": time.perf_counter() - started,
        }
        assert all(p["reduce_scatter_sleeps"] > 0 for p in points), points
        assert all(p["within_bound"] for p in points), points
        return out
    finally:
        dist.destroy_process_group()

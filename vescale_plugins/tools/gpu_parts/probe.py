"""``multi_rank_nccl``: can this machine run several NCCL ranks (on one GPU if it has one)?

Its verdict sets how every later multi-rank part runs (:mod:`.context`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run"]


def _collectives_rank() -> dict[str, Any]:
    """An all-reduce, an all-gather and a reduce-scatter, their values checked."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    gathered = torch.empty(world * 1024, device=device)
    dist.all_gather_into_tensor(gathered, torch.full((1024,), float(rank), device=device))
    reduced = torch.empty(1024, device=device)
    dist.reduce_scatter_tensor(reduced, torch.ones(world * 1024, device=device))
    torch.cuda.synchronize(device)
    want_gathered = torch.arange(world, device=device, dtype=torch.float32).repeat_interleave(1024)
    assert torch.equal(x, torch.full_like(x, world * (world + 1) / 2)), "all_reduce"
    assert torch.equal(gathered, want_gathered), "all_gather_into_tensor"
    assert torch.equal(reduced, torch.full_like(reduced, float(world))), "reduce_scatter_tensor"
    return {"seconds": time.perf_counter() - started, "device": str(device)}


def run(ctx: PartContext) -> dict[str, Any]:
    if ctx.kind != "cuda":
        return {"status": "skipped", "reason": "NCCL only; the CPU fallback's ranks are gloo processes"}
    world = ctx.gpus if ctx.gpus > 1 else 2
    on_one_gpu = ctx.gpus < 2
    probe = dataclasses.replace(ctx, world=world, ranks_on_one_gpu=on_one_gpu)
    ranks = launch(probe, _collectives_rank)
    return {
        "summary": f"{world} NCCL ranks{' on one GPU' if on_one_gpu else ''}: collectives correct",
        "world_size": world,
        "ranks_on_one_gpu": on_one_gpu,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "ranks": ranks,
    }

"""What a part of the device check is told, and how it gets its ranks.

The check decides once (from the GPU count and the ``multi_rank_nccl`` probe) how the
multi-rank parts run: one rank per GPU; several ranks on one GPU, each told a distinct
``NCCL_HOSTID`` so NCCL takes them for separate hosts and connects them over loopback
sockets (it refuses two ranks of one host on one GPU); or, when NCCL refuses even that, one
rank (``world == 1``), said in every part's JSON. A speed figure is only a claim at W > 1 on
separate GPUs: at W=1 FSDP2 issues no collective, and ranks sharing one GPU share its SMs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vescale_plugins.tools.launch import launch_ranks

__all__ = ["PartContext", "one_gpu_rank_env", "launch", "timed_ms"]


def one_gpu_rank_env(rank: int) -> dict[str, str]:
    """NCCL's environment for rank ``rank`` of several on one GPU: its own host id, sockets
    over loopback, no peer-to-peer or shared-memory transport (which need distinct GPUs)."""
    return {
        "NCCL_HOSTID": f"vescale-gpu-check-rank{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
    }


@dataclass(frozen=True)
class PartContext:
    """``kind``: "cuda" or "cpu"; ``gpus``: GPUs seen; ``world``: ranks the multi-rank parts
    use; ``ranks_on_one_gpu``: those ranks share GPU 0; ``world_note``: how ``world`` was
    chosen (the probe's verdict); ``timeout_s``: this part's budget; ``quick``: the suite's
    small run of the CPU fallback."""

    kind: str
    gpus: int
    world: int
    ranks_on_one_gpu: bool
    world_note: str
    timeout_s: float
    quick: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> PartContext:
        return PartContext(**json.loads(text))

    @property
    def speed_claim(self) -> bool:
        """Whether a speed ratio measured with ``world`` ranks says anything about scaling."""
        return self.kind == "cuda" and self.world > 1 and not self.ranks_on_one_gpu

    def figures(self) -> dict[str, Any]:
        """What every multi-rank part reports about its ranks."""
        return {"world_size": self.world, "ranks_on_one_gpu": self.ranks_on_one_gpu, "world_note": self.world_note}


def launch(ctx: PartContext, fn: Callable[..., Any], *args: Any, world: int | None = None) -> list[Any]:
    """``fn(*args)`` on ``world`` (default ``ctx.world``) ranks: NCCL on CUDA, gloo on CPU."""
    world = world or ctx.world
    on_one_gpu = ctx.kind == "cuda" and world > 1 and ctx.ranks_on_one_gpu
    return launch_ranks(
        fn,
        world,
        *args,
        timeout_s=max(5.0, ctx.timeout_s - 5),  # the ranks' own deadline first, so the part says why
        backend="nccl" if ctx.kind == "cuda" else "gloo",
        threads=1,
        rank_env=one_gpu_rank_env if on_one_gpu else None,
    )


def timed_ms(fn: Callable[[], Any], iters: int, warmups: int = 1) -> float:
    """Mean GPU milliseconds of ``fn()`` over ``iters`` runs after ``warmups`` (CUDA events)."""
    for _ in range(warmups):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters

"""``meta_init``: a meta-built model materialised on the device holds only its shards and takes
the unsharded model's values under rank 0's seed.

Two checks. The suite's CUDA-only cases of ``tests/ragged/test_random_init.py`` (``-k
on_cuda``): each slice of a ``uniform_``/``normal_`` draw equals the full draw's, the generator
ends where the full draw leaves it, and the temporary is one window (what
``ragged/dtensor/philox_slice.py`` transcribes from torch's kernel, which only a GPU can
confirm). Then on every rank: the decoder built on meta, sharded, ``to_empty`` on the device and
``reset_parameters()`` with ranks other than 0 seeded differently, against the unsharded
decoder drawn on the device from rank 0's seed: equal parameters, equal next draw, and the peak
allocated during both steps at most this rank's shards, the largest unit's and one window.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.tools import parity_model
from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run"]

SEED = 7
# Small tensors the steps make besides shards (the generator state exchanged once, layout
# bookkeeping), and one random window (4 MiB in fp32 on an H200, philox_slice's bound).
SLACK_BYTES = 8 << 20


def _unit_bytes(model: torch.nn.Module) -> list[int]:
    from vescale_plugins.runtime.state import groups_under

    return [sum(d.sharded.numel() * d.sharded.element_size() for d in unit.dbuffers) for unit in groups_under([model])]


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _meta_init_rank(kind: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from vescale_plugins import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    unsharded = parity_model.make_decoder().to(device)
    torch.manual_seed(SEED)
    unsharded.reset_parameters()
    next_draw = torch.rand(5, device=device)

    with torch.device("meta"):
        model = parity_model.Decoder(parity_model.LAYERS)
    mesh = init_device_mesh(kind, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if kind == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    model.to_empty(device=device)
    torch.manual_seed(SEED if rank == 0 else 100 + rank)
    model.reset_parameters()
    figures: dict[str, Any] = {}
    if kind == "cuda":
        torch.cuda.synchronize()
        units = _unit_bytes(model)
        figures["peak_above_start_bytes"] = torch.cuda.max_memory_allocated() - start
        figures["bound_bytes"] = sum(units) + max(units) + SLACK_BYTES
        figures["largest_unit_gathered_bytes"] = max(units) * world
    mismatched = [
        name
        for (name, p), (_, q) in zip(model.named_parameters(), unsharded.named_parameters(), strict=True)
        if not torch.equal(_full(p), q.detach())
    ]
    figures["parameters_unequal_to_unsharded"] = mismatched
    figures["next_draw_equal"] = torch.equal(torch.rand(5, device=device), next_draw)
    return figures


def _window_tests(timeout_s: float) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[3]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ragged/test_random_init.py"]
    done = subprocess.run([*command, "-k", "on_cuda"], cwd=root, capture_output=True, text=True, timeout=timeout_s)
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-500:]]
    return {"returncode": done.returncode, "pytest": tail[0]}


def run(ctx: PartContext) -> dict[str, Any]:
    figures: dict[str, Any] = {"ranks": launch(ctx, _meta_init_rank, ctx.kind), **ctx.figures()}
    if ctx.kind == "cuda":
        figures["philox_windows"] = _window_tests(ctx.timeout_s / 2)
    failures = []
    for rank, r in enumerate(figures["ranks"]):
        if r["parameters_unequal_to_unsharded"] or not r["next_draw_equal"]:
            failures.append(f"rank {rank}: values or generator differ from the unsharded model's")
        if "bound_bytes" in r and r["peak_above_start_bytes"] > r["bound_bytes"]:
            failures.append(f"rank {rank}: peak {r['peak_above_start_bytes']} B above the bound {r['bound_bytes']} B")
    if "philox_windows" in figures and figures["philox_windows"]["returncode"] != 0:
        failures.append(f"philox windows: {figures['philox_windows']['pytest']}")
    assert not failures, (failures, figures)
    peak = figures["ranks"][0].get("peak_above_start_bytes")
    memory = f", peak {peak / 2**20:.1f} MiB within the shards' bound" if peak is not None else ""
    figures["summary"] = f"meta init: unsharded values under rank 0's seed on {ctx.world} rank(s){memory}"
    return figures

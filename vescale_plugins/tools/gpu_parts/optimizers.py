"""``optimizer_host_syncs``: one steady-state step of every optimizer with no host sync.

torch's fused AdamW (what FSDP2 users step), the flat AdamW, AdamW8bit (its Triton kernel on
CUDA) and Muon (its all-to-all exchange at W > 1) step a fully sharded decoder; the second
step runs under ``torch.cuda.set_sync_debug_mode("error")``, where any host sync (a device
scalar read, a pageable copy) raises. Off CUDA the steps run on plain tensors, unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.optim import AdamW, AdamW8bit, Muon, muon_param_groups, tile_rows
from vescale_plugins.tools import parity_model
from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run", "OPTIMIZERS"]

OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "AdamW (torch, fused)": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
    "flat AdamW": lambda m: AdamW(m.parameters(), lr=1e-3),
    "AdamW8bit": lambda m: AdamW8bit(m.parameters(), lr=1e-3),
    "Muon": lambda m: Muon(muon_param_groups(m, adamw_lr=1e-3), lr=0.02),
}


def _train_step(model: torch.nn.Module, device: torch.device, step: int) -> None:
    tokens, targets = parity_model.local_batch(step)
    parity_model.loss_fn(model(tokens.to(device)), targets.to(device)).backward()


def _optimizer_rank() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    stepped, failed = {}, False
    for name, make in OPTIMIZERS.items():
        try:
            _two_steps(make, mesh, device)
            stepped[name] = "no host sync"
        except Exception as error:  # recorded per optimizer; the next one still steps
            stepped[name] = f"failed: {type(error).__name__}: {error}"[:2000]
            failed = True
    assert not failed, stepped
    return stepped


def _two_steps(make: Callable[[torch.nn.Module], torch.optim.Optimizer], mesh: Any, device: torch.device) -> None:
    from vescale_plugins import fully_shard

    model = parity_model.make_decoder().to(device)
    for layer in model.layers:  # whole 32x32 tiles on each rank, as AdamW8bit needs
        fully_shard(layer, mesh=mesh, block_size_fn=tile_rows())
    fully_shard(model, mesh=mesh, block_size_fn=tile_rows())
    optimizer = make(model)
    _train_step(model, device, 0)
    optimizer.step()  # builds state (quantisation maps are copied to the device once)
    optimizer.zero_grad()
    _train_step(model, device, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _unchecked_steps() -> dict[str, str]:
    stepped = {}
    for name, make in OPTIMIZERS.items():
        if "fused" in name:
            continue  # torch's own; nothing of this package to step on CPU
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 64))
        optimizer = make(model)
        for _ in range(2):
            model(torch.randn(4, 128)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        stepped[name] = "stepped (sync debug mode is CUDA only)"
    return stepped


def run(ctx: PartContext) -> dict[str, Any]:
    if ctx.kind != "cuda":
        return {"summary": "stepped unchecked (sync debug mode is CUDA only)", "optimizers": _unchecked_steps()}
    stepped = launch(ctx, _optimizer_rank)[0]
    return {"summary": f"no host sync at W={ctx.world}: {', '.join(stepped)}", "optimizers": stepped, **ctx.figures()}

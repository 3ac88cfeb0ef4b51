"""One rank of a short stock-FSDP2 training run, started by test_torch_untouched.py.

``--mode plain`` never imports our packages; ``imported`` imports ``vescale_plugins``,
``lightning_strategy`` and ``accelerate_plugin`` first; ``built`` also builds and trains one
veScale unit first (so our torch patches are installed). Rank 0 saves the trained full
parameters to ``--out``, which the test compares across modes bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def _build_and_train_one_of_our_units(mesh) -> None:
    import vescale_plugins
    from vescale_plugins.ragged.dtensor import is_installed

    torch.manual_seed(1)
    unit = vescale_plugins.fully_shard(nn.Linear(8, 6), mesh=mesh)
    unit(torch.randn(3, 8)).sum().backward()
    assert is_installed()
    assert isinstance(unit.weight, DTensor)


def _train_stock_fsdp2(mesh) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 16))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for layer in model:  # random in-place initialisers on Shard(0) DTensors
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()
    adamw = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    sgd = torch.optim.SGD([p for layer in model[1:] for p in layer.parameters()], lr=1e-2, momentum=0.9)
    inputs = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(3):
        loss = model(torch.randn(4, 16, generator=inputs)).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # p-norms of DTensors
        adamw.step()
        sgd.step()
        adamw.zero_grad()
        sgd.zero_grad()
    state = copy.deepcopy(model.state_dict())  # DTensor.__deepcopy__
    saved = io.BytesIO()
    torch.save(state, saved)  # DTensor.__reduce_ex__
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    return {name: tensor.full_tensor() for name, tensor in loaded.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "imported", "built"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode != "plain":
        import accelerate_plugin  # noqa: F401
        import lightning_strategy  # noqa: F401
        import vescale_plugins  # noqa: F401
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        if args.mode == "built":
            _build_and_train_one_of_our_units(mesh)
        full = _train_stock_fsdp2(mesh)
        if args.rank == 0:
            torch.save(full, args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Stock torch's exit race, not ours (it aborts in --mode plain too; pytorch/pytorch#190489):
    # a gloo worker thread releases each finished collective a moment after wait() returns,
    # and the release takes the GIL to drop the collective's tensors. A process that is
    # finalizing by then unwinds the worker mid-destructor: "terminate called without an
    # active exception", SIGABRT (rank 1, 4 exits in 70). DTensor's caches keep the mesh and
    # its group alive, so destroy_process_group joins no worker, and a barrier only moves the
    # race (its release drops the collectives it waited for: 2 aborts in 56 exits). The results
    # are saved and the group destroyed, so this process ends without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Train a small decoder with veScale-FSDP inside torchft replica groups: lose a group, keep
training, and heal it when it comes back.

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    REPLICA_GROUP_ID=0 torchrun --nproc-per-node 2 --master-port 29600 examples/torchft_train.py &
    REPLICA_GROUP_ID=1 torchrun --nproc-per-node 2 --master-port 29601 examples/torchft_train.py
    # kill either torchrun and start it again: it rejoins and heals from the live group

Each replica group is one ordinary FSDP job (torchrun, its own rendezvous) that shards the
model with ``vescale_plugins.fully_shard``; torchft's ``Manager`` averages gradients across
groups in ``set_all_reduce_hook`` (torchtitan's wiring), steps the optimizer only when the
quorum commits, and heals a group that is behind by sending it a live group's state dict
through ``FlatBufferTransport``: one message per flat buffer (see docs/fault_tolerance.md).
The quorum is torchft's default, asynchronous: the live group builds its state dict in
torchft's quorum thread while its own forward runs, which our units allow (``state_dict()``
from another thread reads the sharded parameters and touches nothing). Plain torch and gloo:
runs on CPU; on GPUs pass ``--device cuda``.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_decoder import TinyDecoder
from torch.distributed.device_mesh import init_device_mesh
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

import vescale_plugins
from vescale_plugins.checkpoint.fault_tolerance import FlatBufferTransport


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(args.device, int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (world,))

    model = TinyDecoder()
    for block in model.layers:
        vescale_plugins.fully_shard(block, mesh=mesh)
    vescale_plugins.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    timeout = timedelta(seconds=30)
    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda state: (
            model.load_state_dict(state["model"]),
            optimizer.load_state_dict(state["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"replica{replica}",
        checkpoint_transport=FlatBufferTransport(pg, timeout, device),
        timeout=timeout,
    )
    for module in model.modules():
        if isinstance(module, vescale_plugins.VeScaleFSDPModule):
            module.set_all_reduce_hook(lambda gradient: manager.allreduce(gradient).wait())
    ft_optimizer = OptimizerWrapper(manager, optimizer)

    generator = torch.Generator().manual_seed(replica * 1000 + rank)
    while manager.current_step() < args.steps:
        ft_optimizer.zero_grad()  # the quorum; a group that is behind heals here
        tokens = torch.randint(0, 97, (4, 33), generator=generator).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        ft_optimizer.step()  # only if every group's all-reduce succeeded
        if rank == 0 and manager.current_step() % 20 == 0:
            print(
                f"replica {replica} step {manager.current_step()} participants {manager.num_participants()} loss {loss.item():.4f}"
            )
    manager.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

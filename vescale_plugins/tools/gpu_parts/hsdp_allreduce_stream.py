"""``hsdp_allreduce_stream``: HSDP's all-reduce on its own stream, waited at the end of backward.

The suite's decoder on a ``(replicate, shard)`` mesh (``(2, W/2)``; at W < 4 ``(W, 1)``, which
still takes the all-reduce path) trains a few steps with veScale-FSDP and FSDP2, twice: plainly,
then with a GPU sleep on the side stream before every collective, the all-reduce included
(``parity.provoked_streams``): an all-reduce the compute stream does not wait for, or a buffer
it reads that is freed too early, changes the numbers. Both runs must match FSDP2's and each
other; and the all-reduce must have gone out on the all-reduce stream.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from vescale_plugins.tools import parity_model
from vescale_plugins.tools.gpu_parts import parity
from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run"]


def _hsdp_mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = (2, world // 2) if world >= 4 and world % 2 == 0 else (world, 1)
    return init_device_mesh("cuda", shape, mesh_dim_names=("replicate", "shard"))


def _train(base: torch.nn.Module, fn: Any, mesh: Any, device: torch.device, world: int) -> tuple[Any, list[float]]:
    model = parity._shard(parity_model.clone(base), fn, mesh)
    optimizer = parity._adamw(model)
    losses = []
    for step in range(parity.PARITY_STEPS):
        losses.append(parity._sharded_step(model, step, device, world).item())
        optimizer.step()
        optimizer.zero_grad()
    return model, losses


def _hsdp_rank() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vescale_plugins import fully_shard
    from vescale_plugins.dbuffer.streams import CommStreams

    torch.backends.cuda.matmul.allow_tf32 = False
    device, world = torch.device("cuda", torch.cuda.current_device()), dist.get_world_size()
    mesh = _hsdp_mesh(world)
    base = parity_model.make_decoder().to(device)
    theirs, their_losses = _train(base, torch_fully_shard, mesh, device, world)
    ours, our_losses = _train(base, fully_shard, mesh, device, world)

    on_all_reduce_stream = {"count": 0}
    original = CommStreams.issue_on

    def counted(streams: CommStreams, stream: Any, after: Any = None) -> Any:
        on_all_reduce_stream["count"] += stream is streams.all_reduce
        return original(streams, stream, after=after)

    with (
        mock.patch.object(CommStreams, "issue_on", counted),  # inside the provocation's patch
        parity.provoked_streams(parity.PROVOKING_CYCLES) as counts,
    ):
        provoked, provoked_losses = _train(base, fully_shard, mesh, device, world)
    torch.cuda.synchronize(device)
    tol = parity.PARAM_TOL["cuda"]
    parity._assert_params_close(ours, theirs, tol)
    parity._assert_params_close(provoked, ours, tol)
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(their_losses), **parity.LOSS_TOL["cuda"])
    assert on_all_reduce_stream["count"] > 0, "no all-reduce went out on the all-reduce stream"
    return {
        "mesh": list(mesh.shape),
        "max_param_diff_vs_fsdp2": parity._max_abs_diff(ours, theirs),
        "max_param_diff_provoked_vs_plain": parity._max_abs_diff(provoked, ours),
        "all_reduces_on_their_stream": on_all_reduce_stream["count"],
        **counts,
    }


def run(ctx: PartContext) -> dict[str, Any]:
    figures = {**launch(ctx, _hsdp_rank)[0], **ctx.figures()}
    figures["summary"] = (
        f"HSDP {figures['mesh']}: {figures['all_reduces_on_their_stream']} all-reduces on their stream, "
        f"provoked vs plain {figures['max_param_diff_provoked_vs_plain']:.1e}, vs FSDP2 {figures['max_param_diff_vs_fsdp2']:.1e}"
    )
    return figures

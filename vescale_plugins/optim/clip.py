"""``clip_grad_norm_`` over flat gradient runs: one norm and one scale per run, not per tensor.

Same contract and result as ``torch.nn.utils.clip_grad_norm_`` (total norm over all
gradients as if they were one vector, scaled by ``max_norm / (total + 1e-6)`` when that is
below 1). Sharded (DTensor) gradients contribute their shard and are summed over their mesh
with one all-reduce; replicated ones count once. Returns the total norm as a plain tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from vescale_plugins.optim.flat import contiguous_runs

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients' total ``norm_type``-norm to ``max_norm`` in place; return the norm."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not params:
        return torch.tensor(0.0)
    sharded, replicated, group = [], [], None
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and not all(isinstance(pl, Replicate) for pl in grad.placements):
            if grad.device_mesh.ndim != 1:
                raise ValueError(
                    "clip_grad_norm_: gradients on multi-dimensional meshes are not supported; use torch.nn.utils.clip_grad_norm_"
                )
            mesh_group = grad.device_mesh.get_group(0)
            if group is not None and mesh_group is not group:
                raise ValueError(
                    "clip_grad_norm_: sharded gradients on different meshes; clip each mesh's parameters separately"
                )
            group = mesh_group
            sharded.append(p)
        else:
            replicated.append(p)
    first_grad = params[0].grad
    assert first_grad is not None  # params holds only those with a gradient
    device = first_grad.device
    totals = []
    for members in (sharded, replicated):
        runs = contiguous_runs(members) if members else []
        for run in runs:
            for start, end in run.gaps:
                run.grad_flat[start:end].zero_()
        norms = [torch.linalg.vector_norm(run.grad_flat, norm_type, dtype=torch.float32) for run in runs if run.span]
        if math.isinf(norm_type):
            totals.append(torch.stack(norms).max() if norms else torch.zeros((), device=device))
        else:
            totals.append(torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device))
        if members is sharded and group is not None:
            dist.all_reduce(
                totals[-1], op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group
            )
    total = (
        torch.maximum(totals[0], totals[1]) if math.isinf(norm_type) else (totals[0] + totals[1]).pow(1.0 / norm_type)
    )
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for run in contiguous_runs(params):
        if run.span:
            run.grad_flat.mul_(coefficient.to(run.grad_flat.dtype))
    return total

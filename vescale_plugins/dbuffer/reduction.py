"""How a gradient buffer's reduction scales its sum: FSDP2's arithmetic, step for step.

A mean over ranks can be taken in several ways that round differently: each rank's gradient
multiplied by ``1/W`` before the sum (NCCL's ``AVG`` and ``PREMUL_SUM`` on floating types),
the sum divided by ``W`` (gloo's ``AVG``), a divide by a power of two before the sum and the
rest after (fp16's range), one divide over shard and replicate groups or one per group
(HSDP). FSDP2 picks one per reduce dtype, divide factor and ``set_force_sum_reduction_for_comms``
(``_fsdp_collectives._get_gradient_divide_factors``); :func:`gradient_reduction` picks the
same, so that a gradient reduced here has FSDP2's bits on every backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["GradientReduction", "gradient_reduction"]


@dataclass(frozen=True)
class GradientReduction:
    """The scaling of one reduction, in the order it happens.

    ``pre_divide``: the unsharded gradients divided by it before the reduce-scatter.
    ``reduce_scatter_average``: the reduce-scatter takes the mean over the shard group (the
    backend's ``AVG``). ``premul_divide``: each rank's input multiplied by its inverse inside
    the reduce-scatter (``PREMUL_SUM``; divided by it where the shard group is one rank and
    no collective runs, as FSDP2). ``all_reduce_average``: HSDP's all-reduce takes the mean
    over the replicate group. ``post_divide``: the result divided by it after the all-reduce
    and the all-reduce hook.
    """

    pre_divide: float | None = None
    reduce_scatter_average: bool = False
    premul_divide: float | None = None
    all_reduce_average: bool = False
    post_divide: float | None = None


@functools.cache  # asked per reduce-scatter with few distinct arguments: answered in C after the first
def gradient_reduction(
    reduce_dtype: torch.dtype,
    shard_size: int,
    replicate_size: int,
    divide_factor: float | None,
    force_sum: bool,
) -> GradientReduction:
    """FSDP2's scaling for a reduce-scatter over ``shard_size`` ranks followed (HSDP, when
    ``replicate_size > 1``) by an all-reduce over ``replicate_size`` ranks.

    ``divide_factor``: ``set_gradient_divide_factor``'s (None: every data-parallel rank).
    ``force_sum``: ``set_force_sum_reduction_for_comms(True)``.
    """
    data_parallel_size = shard_size * replicate_size
    # fp32 and bf16 neither overflow nor underflow a mean taken inside the collective.
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if divide_factor is None:
            if data_parallel_size == 1:
                return GradientReduction()
            return GradientReduction(reduce_scatter_average=True, all_reduce_average=True)
        if divide_factor == shard_size:
            return GradientReduction(reduce_scatter_average=True)
        return GradientReduction(premul_divide=divide_factor)
    factor = float(data_parallel_size) if divide_factor is None else divide_factor
    if not overflow_risk:
        return GradientReduction(post_divide=factor)
    # fp16: about sqrt(factor) before the sum (a power of two), the rest after.
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return GradientReduction(pre_divide=float(pre), post_divide=factor / pre)

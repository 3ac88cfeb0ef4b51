"""A reduction's scaling is FSDP2's: the same pre-divide, collective ops and post-divide as
``torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors`` picks,
for every reduce dtype, group size, divide factor and sum-reduction setting."""

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from vescale_plugins.dbuffer.reduction import GradientReduction, gradient_reduction

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHARD_SIZES = [1, 2, 3, 8]
REPLICATE_SIZES = [1, 2, 3]
FACTORS = [None, 1.0, 2.0, 3.0, 8.0, 24.0]


def _group(size):
    return SimpleNamespace(size=lambda: size)


def _fsdp2s(dtype, shard_size, replicate_size, factor, force_sum) -> GradientReduction:
    """FSDP2's choice, in our terms."""
    pre, post, rs_op, ar_op = _get_gradient_divide_factors(
        _group(shard_size),
        _group(replicate_size) if replicate_size > 1 else None,
        dtype,
        "cpu",
        factor,
        force_sum,
    )
    premul_divide = None
    if rs_op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        premul_divide = factor  # ReduceOp.PREMUL_SUM(1 / factor): its scalar is not readable
    return GradientReduction(
        pre_divide=None if pre in (None, 1) else float(pre),
        reduce_scatter_average=rs_op == dist.ReduceOp.AVG,
        premul_divide=premul_divide,
        all_reduce_average=replicate_size > 1 and ar_op == dist.ReduceOp.AVG,
        post_divide=None if post in (None, 1) else float(post),
    )


def _ours(dtype, shard_size, replicate_size, factor, force_sum) -> GradientReduction:
    ours = gradient_reduction(dtype, shard_size, replicate_size, factor, force_sum)
    # Dividing by 1 and not dividing are the same; an all-reduce mean without HSDP never runs.
    return GradientReduction(
        pre_divide=None if ours.pre_divide in (None, 1) else ours.pre_divide,
        reduce_scatter_average=ours.reduce_scatter_average,
        premul_divide=ours.premul_divide,
        all_reduce_average=replicate_size > 1 and ours.all_reduce_average,
        post_divide=None if ours.post_divide in (None, 1) else ours.post_divide,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("force_sum", [False, True])
def test_every_choice_is_fsdp2s(dtype, force_sum):
    for shard_size, replicate_size, factor in itertools.product(SHARD_SIZES, REPLICATE_SIZES, FACTORS):
        args = (dtype, shard_size, replicate_size, factor, force_sum)
        assert _ours(*args) == _fsdp2s(*args), args


def test_means_are_taken_in_each_collective_for_fp32_and_bf16():
    """HSDP over 3 x 2 ranks: the reduce-scatter averages over its 2 ranks, the all-reduce
    over its 3, as FSDP2's AVG ops; no division of the sum over all 6 afterwards. fp16: FSDP2's
    power of two before the sum (4, though it does not divide 6), the rest after."""
    assert gradient_reduction(torch.bfloat16, 2, 3, None, False) == GradientReduction(
        reduce_scatter_average=True, all_reduce_average=True
    )
    assert gradient_reduction(torch.float16, 2, 3, None, False) == GradientReduction(pre_divide=4.0, post_divide=1.5)

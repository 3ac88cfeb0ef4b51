"""The Triton int8 block kernels against the torch ones, on CPU under TRITON_INTERPRET=1.

The interpreter must be switched on before triton is first imported, so the comparison runs
in a subprocess. Codes, scales and dequantized values must be equal bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.distributed  # the comparison runs in a subprocess

REPO = Path(__file__).resolve().parents[2]


def _compare() -> dict:
    """Two ranks' shards of blocks (short, long past the kernel's 256 lanes, zeros, one value,
    outliers) and padding, quantized and dequantized both ways."""
    import torch

    from vescale_plugins.dbuffer import quant_kernels
    from vescale_plugins.dbuffer.quant_triton import (
        dequantize_segments_triton,
        dequantize_sum_segments_triton,
        quantize_segments_triton,
    )

    g = torch.Generator().manual_seed(0)
    shard, chunk = 1536, 1600  # per rank; the gathered chunks hold the codes first
    lengths_per_rank = [[64, 7, 1031, 16, 300, 118], [256, 256, 24, 1000]]  # blocks and padding
    padding = [{3, 5}, {2}]
    starts, lengths, local_slots, global_slots = [], [], [], []
    codes = torch.zeros(2 * chunk, dtype=torch.int8)
    scales = torch.zeros(2, 8)
    results = {"codes_differing": 0, "scales_differing": 0}
    x = torch.randn(2 * shard, generator=g)
    x[100:200] = 0.0
    x[1536 + 300 : 1536 + 500] = 0.75
    x[1536 + 10] = 1e4
    for rank, rank_lengths in enumerate(lengths_per_rank):
        local = torch.tensor(rank_lengths)
        local_starts = torch.cumsum(local, 0) - local
        slots = torch.tensor([-1 if i in padding[rank] else i for i in range(len(rank_lengths))])
        slots = torch.where(slots >= 0, torch.cumsum(slots >= 0, 0) - 1, -1)
        source = x[rank * shard : (rank + 1) * shard]
        out_codes = [torch.empty(shard, dtype=torch.int8) for _ in range(2)]
        out_scales = [torch.empty(8) for _ in range(2)]
        segments = quant_kernels.Segments.of(local_starts, local, slots, shard)
        quant_kernels.quantize_segments(source, segments, out_codes[0], out_scales[0])
        quantize_segments_triton(source, segments, out_codes[1], out_scales[1], shard, shard, shard)
        results["codes_differing"] += int((out_codes[0] != out_codes[1]).sum())
        results["scales_differing"] += int((out_scales[0] != out_scales[1]).sum())
        codes[rank * chunk : rank * chunk + shard] = out_codes[0]
        scales[rank] = out_scales[0]
        starts.append(local_starts + rank * shard)
        lengths.append(local)
        global_slots.append(torch.where(slots >= 0, slots + rank * 8, -1))
        local_slots.append(slots)
    whole = quant_kernels.Segments.of(torch.cat(starts), torch.cat(lengths), torch.cat(global_slots), shard)
    for dtype in (torch.float32, torch.bfloat16):
        outs = [torch.full((2 * shard,), 7.0, dtype=dtype) for _ in range(2)]
        flat_scales = scales.reshape(-1)
        quant_kernels.dequantize_segments(codes, chunk, shard, flat_scales, whole, outs[0])
        dequantize_segments_triton(codes, chunk, shard, flat_scales, whole, outs[1])
        results[f"dequantized_equal_{str(dtype)[6:]}"] = bool(torch.equal(outs[0], outs[1]))
    nan = x[:1536].clone()
    nan[70] = float("nan")
    nan_scales = torch.empty(8)
    local = torch.tensor(lengths_per_rank[0])
    quantize_segments_triton(
        nan,
        quant_kernels.Segments.of(torch.cumsum(local, 0) - local, local, local_slots[0], shard),
        torch.empty(shard, dtype=torch.int8),
        nan_scales,
        shard,
        shard,
        shard,
    )
    results["nan_scale"] = bool(torch.isnan(nan_scales[1]))  # element 70 lies in the second block
    # A gradient buffer's rank chunks (shard elements, then flags) into packed messages.
    grad_chunk = shard + 16
    grads = torch.randn(2 * grad_chunk, generator=g)
    strided = []
    for quantize in (quant_kernels.quantize_segments, quantize_segments_triton):
        out_codes, out_scales = torch.zeros(2 * chunk, dtype=torch.int8), torch.empty(16)
        extra = dict(shard=shard, source_chunk=grad_chunk, codes_chunk=chunk)
        args = (grads, whole, out_codes, out_scales)
        quantize(*args, **extra) if quantize is quant_kernels.quantize_segments else quantize(*args, *extra.values())
        strided.append((out_codes, out_scales))
    results["strided_codes_equal"] = bool(torch.equal(strided[0][0], strided[1][0]))
    results["strided_scales_equal"] = bool(torch.equal(strided[0][1], strided[1][1]))
    # Each rank's shard summed over both senders, dequantized.
    sums = []
    for rank in range(2):
        local = torch.tensor(lengths_per_rank[rank])
        local_starts = torch.cumsum(local, 0) - local
        pair = [torch.empty(shard) for _ in range(2)]
        received = torch.cat([codes[:shard], codes[chunk : chunk + shard]]) if rank == 0 else codes
        received_chunk = shard if rank == 0 else chunk
        flat_scales = scales.reshape(-1)
        segments = quant_kernels.Segments.of(local_starts, local, local_slots[rank], shard)
        args = (received, received_chunk, flat_scales, 8, segments)
        quant_kernels.dequantize_sum_segments(*args, pair[0])
        dequantize_sum_segments_triton(*args, pair[1], 2)
        sums.append(bool(torch.equal(pair[0], pair[1])))
    results["sums_equal"] = sums
    return results


def test_triton_block_kernels_match_the_torch_ones_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = f"import json, {__name__} as t; print('REPORT' + json.dumps(t._compare()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("REPORT", 1)[1])
    assert report == {
        "codes_differing": 0,
        "scales_differing": 0,
        "dequantized_equal_float32": True,
        "dequantized_equal_bfloat16": True,
        "nan_scale": True,
        "strided_codes_equal": True,
        "strided_scales_equal": True,
        "sums_equal": [True, True],
    }, report


def _ptx_for_hopper(kernel_name: str, pointers: dict[str, str], constants: dict[str, object]) -> str:
    """A kernel compiled ahead of time for sm_90 (Triton's own compiler and ptxas; no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vescale_plugins.dbuffer import quant_triton

    kernel = getattr(quant_triton, kernel_name)
    names = kernel.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i64") for n in names}
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in pointers},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_triton_block_kernels_compile_for_hopper_with_correctly_rounded_division():
    tables = dict(starts_ptr="*i64", lengths_ptr="*i64", slots_ptr="*i64")
    quantize = _ptx_for_hopper(
        "_quantize_kernel",
        dict(tables, x_ptr="*fp32", codes_ptr="*i8", scales_ptr="*fp32"),
        dict(BLOCK=256),
    )
    assert "div.rn.f32" in quantize
    for instruction in ("div.full", "div.approx"):
        assert instruction not in quantize, instruction
    dequantize = _ptx_for_hopper(
        "_dequantize_kernel",
        dict(tables, codes_ptr="*i8", scales_ptr="*fp32", out_ptr="*bf16"),
        dict(BF16=True, BLOCK=256),
    )
    assert "st.global" in dequantize

"""``quantized_collectives``: the int8 block kernels' GB/s on the GPU against a plain copy of
the same bytes, their codes against the torch path's, and a unit's quantized all-gather
end to end against its bf16 one at the ranks the check uses.

Kernels: 64M fp32 elements in blocks of 256 quantized to int8 (5 bytes per element moved),
and the codes dequantized to bf16 (3 bytes per element), each timed with CUDA events
against ``copy_`` of as many bytes. Gathers: ``unshard()`` + ``reshard()`` of one unit of
8 Linear(4096, 4096) layers under bf16 mixed precision, exact and with
``QuantizedComm(weights="int8")``; the gathered weights' largest error against half a
block's step (``scale / 2``) is checked too.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from vescale_plugins.tools.gpu_parts.context import PartContext, launch, timed_ms

__all__ = ["run"]

ELEMENTS, BLOCK, ITERS = 1 << 26, 256, 10
LAYERS, HIDDEN, GATHERS = 8, 4096, 10


def _kernels() -> dict[str, Any]:
    from vescale_plugins.dbuffer import quant_kernels
    from vescale_plugins.dbuffer.quant_kernels import Segments

    device = torch.device("cuda", 0)
    x = torch.randn(ELEMENTS, device=device)
    starts = torch.arange(0, ELEMENTS, BLOCK, device=device)
    segments = Segments(starts, torch.full_like(starts, BLOCK), torch.arange(starts.numel(), device=device), ())
    codes = torch.empty(ELEMENTS, dtype=torch.int8, device=device)
    scales = torch.empty(starts.numel(), device=device)
    out = torch.empty(ELEMENTS, dtype=torch.bfloat16, device=device)
    quantize_ms = timed_ms(lambda: quant_kernels.quantize_segments(x, segments, codes, scales), ITERS)
    dequantize_ms = timed_ms(
        lambda: quant_kernels.dequantize_segments(codes, ELEMENTS, ELEMENTS, scales, segments, out), ITERS
    )
    # A copy that moves 5 bytes per element, as quantize does (half read, half written).
    source = torch.empty(5 * ELEMENTS // 2, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_ms = timed_ms(lambda: target.copy_(source), ITERS)
    error = (out.float() - x).abs()
    step = scales.repeat_interleave(BLOCK)
    return {
        "quantize_gb_per_s": 5 * ELEMENTS / quantize_ms / 1e6,
        "dequantize_gb_per_s": 3 * ELEMENTS / dequantize_ms / 1e6,
        "copy_gb_per_s": 5 * ELEMENTS / copy_ms / 1e6,
        "max_error_over_half_step": float((error / (step / 2 + x.abs() * 2**-8)).max()),
    }


def _gathers(quantized: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from vescale_plugins import QuantizedComm, VeScaleFSDPModule, fully_shard

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)]).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    unit = cast(VeScaleFSDPModule, fully_shard(model, mp_policy=mp, comm_policy=QuantizedComm() if quantized else None))

    def gather() -> None:
        unit.unshard()
        unit.reshard()

    gather_ms = timed_ms(gather, GATHERS, warmups=2)
    dist.barrier()
    return {"gather_ms": gather_ms}


def run(ctx: PartContext) -> dict[str, Any]:
    if ctx.kind != "cuda":
        return {
            "status": "skipped",
            "reason": "CUDA only: the CPU runs the torch kernels; tests/dbuffer/test_quant_triton.py runs "
            "the Triton ones under TRITON_INTERPRET=1",
        }
    try:
        import triton  # noqa: F401  (the CUDA path's kernels)
    except ImportError:
        return {"status": "skipped", "reason": "triton is not installed: the torch kernels run on CUDA"}
    torch.cuda.set_device(0)
    start = time.perf_counter()
    figures: dict[str, Any] = {"kernels": _kernels()}
    exact = launch(ctx, _gathers, False)
    quantized = launch(ctx, _gathers, True)
    figures["gathers"] = {
        **ctx.figures(),
        "bf16_gather_ms": max(r["gather_ms"] for r in exact),
        "int8_gather_ms": max(r["gather_ms"] for r in quantized),
        "speed_claim": ctx.speed_claim,
    }
    figures["gathers"]["int8_over_bf16"] = figures["gathers"]["int8_gather_ms"] / figures["gathers"]["bf16_gather_ms"]
    figures["seconds"] = time.perf_counter() - start
    return figures

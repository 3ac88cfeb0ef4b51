"""``triton_kernels``: the Triton 8-bit AdamW kernel compiled for CUDA, against the torch reference.

One flat run of several parameters (2-D with partial edge tiles, 1-D, 0-D, a 3-D; padding
between them, as in a DBuffer run) is stepped by the Triton kernel and by the torch
reference (:func:`~vescale_plugins.optim.kernels.adam8bit_torch.adam8bit_step_`) from the
same state, each step from the reference's state so every step is compared on its own:
codes within one step of the reference's, the share that differ (fused multiply-adds can
move a value across a rounding boundary), parameters and scales. Then its throughput
against ``torch._fused_adamw_`` over the same elements (bytes each kernel must move: 16 per
element for the 8-bit step, 28 for fp32 AdamW). The test suite runs the comparison under
``TRITON_INTERPRET=1`` (tests/optim/kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vescale_plugins.tools.gpu_parts.context import PartContext, timed_ms

__all__ = ["compare_with_reference", "run"]

# A DBuffer-like run: 16-element aligned members (so the kernel's loads are vectors).
TIMED_SHAPES = [(4096, 4096), (4096, 4096), (3072, 4096), (4096, 1024), (1 << 20,)]
CHECKED_SHAPES = [(1000, 997), (70,), (), (5, 3, 4), (4096, 512), (123_457,)]
TIMED_ITERS = 20


@dataclass(frozen=True)
class _Run:
    """A flat run's layout: each member's grid, element offset and first scale index."""

    grids: list[Any]
    offsets: list[int]
    scale_offsets: list[int]
    span: int
    tiles: int
    table: Any

    @staticmethod
    def of(shapes: Sequence[tuple[int, ...]], tile: int, gap: int, device: str | torch.device) -> _Run:
        from vescale_plugins.optim.kernels.adam8bit_triton import tile_table
        from vescale_plugins.optim.tiles import TileGrid

        grids = [TileGrid.of(s, tile) for s in shapes]
        offsets, scale_offsets, at, tiles = [], [], 0, 0
        for g in grids:
            offsets.append(at)
            scale_offsets.append(tiles)
            at += g.numel + gap
            tiles += g.num_tiles
        members = [(o, (g.rows, g.cols), s) for o, g, s in zip(offsets, grids, scale_offsets)]
        table = tile_table(members, [(g.tile_h, g.tile_w) for g in grids], tile, device)
        return _Run(grids, offsets, scale_offsets, at, tiles, table)

    def reference_step(self, state: list[torch.Tensor], grad: torch.Tensor, hyper: Any) -> None:
        """The torch reference on every member of ``state`` (param, codes, scales, codes, scales)."""
        from vescale_plugins.optim.kernels.adam8bit_torch import adam8bit_step_

        p, mc, ms, vc, vs = state
        for o, g, s in zip(self.offsets, self.grids, self.scale_offsets):
            el, sc = slice(o, o + g.numel), slice(s, s + g.num_tiles)
            rows, cols, tile_rows, tile_cols = g.rows, g.cols, g.tile_rows, g.tile_cols
            mat = lambda t: t[el].view(rows, cols)
            sca = lambda t: t[sc].view(tile_rows, tile_cols)
            adam8bit_step_(mat(p), mat(grad), mat(mc), sca(ms), mat(vc), sca(vs), g.tile_h, g.tile_w, hyper)


def compare_with_reference(
    shapes: Sequence[tuple[int, ...]], tile: int, device: str | torch.device, steps: int = 2, gap: int = 3
) -> dict[str, Any]:
    """Step one run of ``shapes`` (``gap`` padding elements after each) both ways; per step,
    how far the kernel's parameters, codes and scales are from the reference's."""
    from vescale_plugins.optim.kernels.adam8bit_torch import AdamHyper
    from vescale_plugins.optim.kernels.adam8bit_triton import adam8bit_tiles_

    gen = torch.Generator().manual_seed(0)
    run = _Run.of(shapes, tile, gap, device)
    span, tiles, table = run.span, run.tiles, run.table
    torch_state = [
        torch.randn(span, generator=gen).to(device),
        torch.zeros(span, dtype=torch.uint8, device=device),
        torch.zeros(tiles, device=device),
        torch.zeros(span, dtype=torch.uint8, device=device),
        torch.zeros(tiles, device=device),
    ]
    covered = torch.zeros(span, dtype=torch.bool, device=device)
    for o, g in zip(run.offsets, run.grids):
        covered[o : o + g.numel] = True
    report: dict[str, Any] = {"span": span, "tiles": tiles, "align": table.align, "steps": []}
    for step in range(1, steps + 1):
        kernel_state = [t.clone() for t in torch_state]  # each step from the reference's state
        grad = torch.randn(span, generator=gen).to(device)
        hyper = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, decoupled=step % 2 == 1)
        p, mc, ms, vc, vs = kernel_state
        adam8bit_tiles_(p, grad, mc, ms, vc, vs, table, hyper)
        run.reference_step(torch_state, grad, hyper)
        code_pairs = [(kernel_state[1], torch_state[1]), (kernel_state[3], torch_state[3])]
        scale_pairs = [(kernel_state[2], torch_state[2]), (kernel_state[4], torch_state[4])]
        differing = sum(int((a[covered] != b[covered]).sum()) for a, b in code_pairs)
        report["steps"].append(
            {
                "param_max_abs_diff": (kernel_state[0] - torch_state[0]).abs().max().item(),
                "padding_untouched": bool(torch.equal(kernel_state[0][~covered], torch_state[0][~covered])),
                "code_max_diff": max((a.int() - b.int()).abs().max().item() for a, b in code_pairs),
                "codes_differing": differing,
                "codes_total": 2 * int(covered.sum()),
                "scale_max_rel_diff": max(((a - b).abs() / b).max().item() for a, b in scale_pairs),
            }
        )
    return report


def throughput(shapes: Sequence[tuple[int, ...]], tile: int = 32) -> dict[str, Any]:
    """Milliseconds and GB/s of the Triton step, the torch 8-bit reference and fp32
    ``torch._fused_adamw_`` over the same elements."""
    from vescale_plugins.optim.kernels.adam8bit_torch import AdamHyper, step_tensor
    from vescale_plugins.optim.kernels.adam8bit_triton import adam8bit_tiles_

    device = torch.device("cuda", torch.cuda.current_device())
    run = _Run.of(shapes, tile, 0, device)
    n, tiles, table = run.span, run.tiles, run.table
    p, grad = torch.randn(n, device=device), torch.randn(n, device=device)
    codes = [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(2)]
    scales = [torch.zeros(tiles, device=device) for _ in range(2)]
    hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 10)
    triton_ms = timed_ms(
        lambda: adam8bit_tiles_(p, grad, codes[0], scales[0], codes[1], scales[1], table, hyper), TIMED_ITERS, 2
    )

    state = [p, codes[0], scales[0], codes[1], scales[1]]
    reference_ms = timed_ms(lambda: run.reference_step(state, grad, hyper), TIMED_ITERS, 2)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step = step_tensor(10, device)
    fused_ms = timed_ms(
        lambda: torch._fused_adamw_(
            [p], [grad], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
            amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
        ),
        TIMED_ITERS,
        2,
    )  # fmt: skip
    gbps = lambda bytes_per_element, ms: bytes_per_element * n / ms / 1e6
    return {
        "elements": n,
        "align": table.align,
        "triton_8bit_ms": triton_ms,
        "torch_8bit_reference_ms": reference_ms,
        "fused_adamw_fp32_ms": fused_ms,
        "triton_8bit_gb_per_s": gbps(16, triton_ms),
        "fused_adamw_fp32_gb_per_s": gbps(28, fused_ms),
        "triton_time_over_fused_adamw": triton_ms / fused_ms,
    }


def run(ctx: PartContext) -> dict[str, Any]:
    try:
        import triton
    except ImportError:
        return {"status": "skipped", "reason": "triton is not installed"}
    if ctx.kind != "cuda":
        return {
            "status": "skipped",
            "reason": "no CUDA: the test suite runs the kernel under TRITON_INTERPRET=1 (tests/optim/kernels)",
            "triton": triton.__version__,
        }
    report = compare_with_reference(CHECKED_SHAPES, 32, "cuda", steps=3)
    flips = sum(s["codes_differing"] for s in report["steps"]) / sum(s["codes_total"] for s in report["steps"])
    report["code_flip_share"] = flips
    for step in report["steps"]:
        assert step["code_max_diff"] <= 1 and step["padding_untouched"], step
        assert step["param_max_abs_diff"] < 1e-5 and step["scale_max_rel_diff"] < 1e-4, step
    speed = throughput(TIMED_SHAPES)
    summary = (
        f"code flip share {flips:.1e}; {speed['triton_8bit_ms']:.3f} ms ({speed['triton_8bit_gb_per_s']:.0f} GB/s) "
        f"vs fused AdamW {speed['fused_adamw_fp32_ms']:.3f} ms ({speed['fused_adamw_fp32_gb_per_s']:.0f} GB/s)"
    )
    return {"summary": summary, "triton": triton.__version__, "comparison": report, "throughput": speed}

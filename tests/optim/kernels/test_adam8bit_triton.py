"""The Triton 8-bit AdamW kernel against the torch reference, on CPU under TRITON_INTERPRET=1.

The interpreter must be switched on before triton is first imported, so the comparison runs
in a fresh interpreter process (``_compare`` below) and this test checks what it reports.
Sizes are tiny: the interpreter runs each tile program in numpy.
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

REPO = Path(__file__).resolve().parents[3]


def _compare() -> dict:
    """One flat run of several parameters (edges, 1-D, 0-D, a 3-D) stepped both ways."""
    import torch

    from vescale_plugins.optim.kernels.adam8bit_torch import AdamHyper, adam8bit_step_
    from vescale_plugins.optim.kernels.adam8bit_triton import adam8bit_tiles_, tile_table
    from vescale_plugins.optim.tiles import TileGrid

    gen = torch.Generator().manual_seed(0)
    tile = 8
    grids = [TileGrid.of(s, tile) for s in [(20, 13), (70,), (), (5, 3, 4)]]
    # Members sit at offsets with padding between them, as in a DBuffer run.
    offsets, scale_offsets, at, tiles = [], [], 0, 0
    for g in grids:
        offsets.append(at)
        scale_offsets.append(tiles)
        at += g.numel + 3
        tiles += g.num_tiles
    span = at
    table = tile_table(
        [(o, (g.rows, g.cols), s) for o, g, s in zip(offsets, grids, scale_offsets)],
        [(g.tile_h, g.tile_w) for g in grids],
        "cpu",
    )
    triton_state = [
        torch.randn(span, generator=gen),
        torch.zeros(span, dtype=torch.uint8),
        torch.zeros(tiles),
        torch.zeros(span, dtype=torch.uint8),
        torch.zeros(tiles),
    ]
    torch_state = [t.clone() for t in triton_state]
    report = {"steps": []}
    for step in (1, 2):
        grad = torch.randn(span, generator=gen)
        hyper = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, decoupled=step == 1)
        p, mc, ms, vc, vs = triton_state
        adam8bit_tiles_(p, grad, mc, ms, vc, vs, table, tile * tile, hyper)
        for o, g, s in zip(offsets, grids, scale_offsets):
            el, sc = slice(o, o + g.numel), slice(s, s + g.num_tiles)
            mat = lambda t: t[el].view(g.rows, g.cols)
            sca = lambda t: t[sc].view(g.tile_rows, g.tile_cols)
            adam8bit_step_(
                mat(torch_state[0]),
                mat(grad),
                mat(torch_state[1]),
                sca(torch_state[2]),
                mat(torch_state[3]),
                sca(torch_state[4]),
                g.tile_h,
                g.tile_w,
                hyper,
            )
        covered = torch.zeros(span, dtype=torch.bool)
        for o, g in zip(offsets, grids):
            covered[o : o + g.numel] = True
        report["steps"].append(
            {
                "param_max_abs_diff": (triton_state[0] - torch_state[0]).abs().max().item(),
                "padding_untouched": bool(torch.equal(triton_state[0][~covered], torch_state[0][~covered])),
                "code_max_diff": max(
                    (a.int() - b.int()).abs().max().item()
                    for a, b in ((triton_state[1], torch_state[1]), (triton_state[3], torch_state[3]))
                ),
                "codes_differing": sum(
                    int((a != b).sum())
                    for a, b in ((triton_state[1], torch_state[1]), (triton_state[3], torch_state[3]))
                ),
                "codes_total": 2 * int(covered.sum()),
                "scale_max_rel_diff": max(
                    ((a - b).abs() / b).max().item()
                    for a, b in ((triton_state[2], torch_state[2]), (triton_state[4], torch_state[4]))
                ),
            }
        )
        # Continue from the reference's state so the check is per step.
        triton_state = [t.clone() for t in torch_state]
    return report


def test_triton_kernel_matches_the_torch_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = f"import json, {__name__} as t; print('REPORT' + json.dumps(t._compare()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("REPORT", 1)[1])
    for step in report["steps"]:
        assert step["param_max_abs_diff"] < 1e-6, step
        assert step["padding_untouched"], step
        assert step["code_max_diff"] <= 1, step
        assert step["codes_differing"] <= max(1, step["codes_total"] // 1000), step
        assert step["scale_max_rel_diff"] < 1e-5, step
